"""The prompts a rows file has not answered yet, for the pipelines that answer a prompt set in two parts.

    python -m benchmarks.pipelines.prompts_left PROMPTS ROWS OUT

Writes to OUT the lines of PROMPTS (`draftforge target prompts` JSONL) whose prompt_id no row of ROWS (`draftforge
generate` output; absent = nothing answered) has, in PROMPTS' order, and says how many.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def prompts_left(prompts: Path, rows: Path) -> tuple[int, list[str]]:
    """(how many prompts ROWS answered, the lines of PROMPTS it did not answer)."""
    done = {json.loads(line)["prompt_id"] for line in rows.open()} if rows.is_file() else set()
    return len(done), [line for line in prompts.open() if json.loads(line)["prompt_id"] not in done]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("prompts", type=Path, help="JSONL of prompts, each with a prompt_id")
    p.add_argument("rows", type=Path, help="rows answered so far (draftforge generate's output; may not exist)")
    p.add_argument("out", type=Path, help="where the unanswered prompts go (written whole each time)")
    args = p.parse_args(argv)
    answered, left = prompts_left(args.prompts, args.rows)
    args.out.write_text("".join(left))
    print(f"{answered} prompts answered in {args.rows}, {len(left)} left in {args.out}")


if __name__ == "__main__":
    main()
