"""lm-eval task files for the tests: a multiple-choice task (log likelihoods) and a
generate_until task over one JSONL file of {"question", "choices", "answer"} rows."""

from __future__ import annotations

from pathlib import Path


def write_tasks(folder: Path, rows: Path, prefix: str, doc_to_text: str, max_gen_toks: int,
                match_options: str = "") -> tuple[str, str]:
    """`mc.yaml` and `gen.yaml` in `folder` (lm-eval's `include_path`); their task names,
    `{prefix}_mc` and `{prefix}_gen`. `match_options`: more YAML lines of exact_match."""
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {rows}\n"
              f"test_split: test\ndoc_to_text: \"{doc_to_text}\"\n")
    mc, gen = f"{prefix}_mc", f"{prefix}_gen"
    (folder / "mc.yaml").write_text(
        f"task: {mc}\n" + common + "output_type: multiple_choice\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\n"
        "metric_list:\n  - metric: acc\n")
    (folder / "gen.yaml").write_text(
        f"task: {gen}\n" + common + "output_type: generate_until\n"
        "doc_to_target: \"{{choices[answer]}}\"\n"
        f"generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: {max_gen_toks}\n"
        "  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n" + match_options)
    return mc, gen
