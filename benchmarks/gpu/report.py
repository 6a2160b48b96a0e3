"""check.md of the GPU check: the machine in one line, one row per step (status, seconds, result), then each
step's own table and notes, and the error of every failed step. Reads only check.json's dict."""

from __future__ import annotations


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(headers: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(_cell(h) for h in headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    return lines + ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]


def machine_line(check: dict) -> str:
    env = check.get("environment") or {}
    pkgs = env.get("packages") or {}
    parts = [env.get("device_name", check.get("device", "?")), f"torch {env.get('torch', '?')}"]
    if env.get("cuda"):
        parts.append(f"CUDA {env['cuda']}")
    parts += [f"{name} {pkgs[name]}" for name in ("triton", "transformers") if pkgs.get(name)]
    parts += [f"Python {env.get('python', '?')}", f"{env.get('torch_threads', '?')} torch thread(s)"]
    return " · ".join(parts)


def step_result(record: dict) -> str:
    if record["status"] == "ok":
        return (record.get("result") or {}).get("summary", "")
    if record["status"] == "failed":
        partial = (record.get("result") or {}).get("summary")
        return record["error"] + (f" ({partial})" if partial else "")
    return record["reason"]


def markdown(check: dict) -> str:
    """The whole check.md."""
    t = check["tally"]
    commit = f" · commit {check['commit']}" if check.get("commit") else ""
    lines = ["# GPU check" + (" (dry run: CPU, toy sizes)" if check["dry_run"] else ""), "",
             machine_line(check), "",
             f"{check['started']} · {t['ok']} ok, {t['failed']} failed, {t['skipped']} skipped in "
             f"{check['seconds']:.0f} s · `{check['command']}`{commit}", ""]
    warnings = (check.get("environment") or {}).get("warnings", [])
    lines += [f"- warning: {w}" for w in warnings] + ([""] if warnings else [])
    rows = [[f"{i}. {r['name']}", r["title"], r["status"].upper() if r["status"] == "failed" else r["status"],
             f"{r['seconds']:.1f}", step_result(r)] for i, r in enumerate(check["steps"], 1)]
    lines += _table(["step", "what", "status", "seconds", "result"], rows)
    for record in check["steps"]:
        while lines and lines[-1] == "":
            lines.pop()
        lines += _details(record)
    return "\n".join(lines).rstrip() + "\n"


def _details(record: dict) -> list[str]:
    result = record.get("result") or {}
    if not result.get("table") and record["status"] != "failed" and not result.get("notes"):
        return []
    lines = ["", f"## {record['name']}: {record['title']}", ""]
    if result.get("table"):
        lines += _table(result["table"]["headers"], result["table"]["rows"]) + [""]
    lines += [f"- {note}" for note in result.get("notes", [])]
    if record["status"] == "failed":
        lines += [f"- **failed**: {record['error']}" + (f" (log: `{record['log']}`)" if record.get("log") else "")]
    return lines
