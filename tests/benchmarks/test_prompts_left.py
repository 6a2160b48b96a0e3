"""benchmarks/pipelines/prompts_left.py: the prompts a rows file has not answered, in the prompts' order."""

from __future__ import annotations

import json

from benchmarks.pipelines.prompts_left import main


def test_the_unanswered_prompts_in_their_order_and_all_of_them_without_a_rows_file(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    lines = [json.dumps({"prompt_id": f"p{i}", "messages": [{"role": "user", "content": str(i)}]}) + "\n"
             for i in range(5)]
    prompts.write_text("".join(lines))
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"input_ids": [1, 2], "prompt_len": 1, "prompt_id": pid, "temperature": 0.0})
                            + "\n" for pid in ("p3", "p0")))  # answered out of order, as generate writes them
    main([str(prompts), str(rows), str(tmp_path / "rest.jsonl")])
    assert (tmp_path / "rest.jsonl").read_text() == lines[1] + lines[2] + lines[4]
    assert "2 prompts answered" in capsys.readouterr().out
    main([str(prompts), str(tmp_path / "absent.jsonl"), str(tmp_path / "all.jsonl")])
    assert (tmp_path / "all.jsonl").read_text() == "".join(lines)
