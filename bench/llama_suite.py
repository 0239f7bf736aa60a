"""llama.cpp's own server tests (tools/server/tests of a llama.cpp checkout) against `moeserve serve`: the
tool-call, response_format, n and Responses API categories.

    python bench/llama_suite.py --llama-repo DIR [--work /tmp/llama_suite] [--category tools ...]

Builds a tiny random Qwen3-MoE checkpoint once (tests/serve/qwen_chat.py: byte-level BPE tokenizer, <|im_end|> the
EOS), points their harness at bench/llama_server_adapter.py (LLAMA_SERVER_BIN_PATH), runs the chosen cases with
pytest in DIR/tools/server/tests and writes a JSON summary to bench/results: per category the cases passed,
failed, not applicable (a failure of a case NOT_APPLICABLE names, with the reason) and skipped, each failure with
its first error line; a pass that proves less than its name (CAVEATS) says why. Their code is read from DIR, never copied here. Their utils.py imports `wget` (for
downloads these cases never make); when it is not installed, a module of that name that refuses to download is put
on their path."""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
ADAPTER = HERE / "llama_server_adapter.py"

CATEGORIES = {  # category -> pytest node ids under tools/server/tests (a file::test selects all its cases)
    "tools": ["unit/test_tool_call.py::test_completion_with_required_tool_tiny_fast",
              "unit/test_tool_call.py::test_completion_without_tool_call_fast"],
    "response_format": ["unit/test_chat_completion.py::test_completion_with_response_format",
                        "unit/test_chat_completion.py::test_completion_with_json_schema"],
    "n": ["unit/test_chat_completion.py::test_chat_completions_multiple_choices"],
    "responses": ["unit/test_compat_oai_responses.py"],
}

TRAINED = "asserts words a trained model writes (the harness's stories260K GGUF); a random checkpoint writes none"
NOT_APPLICABLE = [  # (case-name regex, first-error-line regex, why such a failure says nothing about moeserve)
    (r"CompletionMode\.STREAMED", r"^AssertionError: Expected non empty content delta!$",
     "the harness refuses an empty content delta; moeserve's first chunk is OpenAI's (and vLLM's) "
     '{"role": "assistant", "content": ""}. With that one assertion relaxed these cases passed, except the '
     "python tool's (its unclosed string, below)"),
    (r"test_completion_with_required_tool_tiny_fast\[google-gemma-2-2b-it", r"",
     "gemma-2's template teaches no tool-call format: llama.cpp falls back to its own generic JSON format, "
     "moeserve refuses tools for such a template (400, docs/serve.md)"),
    (r"test_completion_with_required_tool_tiny_fast\[meta-llama-Llama-3\.3-70B-Instruct-tool[45]-code",
     r'Expected 1 tool call in .*\{"name": "python", "parameters": \{ *"code": "',
     "the forced call's free-text `code` string never ends: the random checkpoint does not close it within "
     "the case's 1024 tokens (the grammar allows the quote at every step; a trained model writes it)"),
    (r"test_completion_with_response_format\[response_format[01]-", r"",
     "a `schema` under type json_object is llama.cpp's own extension (OpenAI's json_object takes none; "
     "moeserve holds the answer to a JSON object and ignores it)"),
    (r"test_completion_with_response_format\[response_format3-", r"", TRAINED + " ('John' or '{' repeated)"),
    (r"test_completion_with_json_schema\[", r"",
     "the top-level `json_schema` request field is llama.cpp's own (OpenAI's is response_format)"),
    (r"test_chat_completions_multiple_choices", r"match_regex|assert False", TRAINED + " ('Suddenly|Timmy')"),
    (r"test_responses_(stream_)?with_openai_library", r"model `gpt-4\.1` does not exist",
     "sends model gpt-4.1: llama-server answers any model name, moeserve (as vLLM) a 404 model_not_found for "
     "one it does not serve; with the served name the streamed case passes, the whole one then asserts "
     + TRAINED + " ('Suddenly')"),
    (r"test_responses_with_text_format\[text_format1-", r"", TRAINED + " ('Suddenly' or '{' repeated)"),
    (r"test_responses_stream_with_llama_telemetry", r"",
     "llama.cpp's own fields (timings_per_token, return_progress: prompt_progress, timings)"),
]
CAVEATS = {  # case-name regex -> why a pass of it proves less than its name says
    r"test_completion_with_response_format\[response_format1-":
        "a schema under json_object is llama.cpp's extension (ignored), and the regex '[ -3000 ]' is a character "
        "class: a pass is an answer that happens to hold a space, '-', '0' or '3'",
    r"test_completion_with_response_format\[response_format[4-7]-":
        "max_tokens 0 is refused (400) before the format is read; alone, {'type': 'sound'} is a 400 and a "
        "schema under json_object (llama.cpp's extension) is ignored",
}
OUT_OF_SCOPE = {  # tests of the chosen files that need a real model from the hub (pytest marks them slow)
    "test_tool_call.py (slow)": "test_completion_with_required_tool_real_model, test_completion_without_tool_call_slow,"
                                " test_weather, test_calc_result, test_thoughts, test_hello_world: a real model's "
                                "knowledge (which tool, the weather city, a sum, hello world code) from hub GGUFs",
}
WGET_SHIM = '"""Stands in for the wget package: these cases download nothing."""\n\n\ndef download(url, out=None):\n' \
            '    raise RuntimeError(f"no downloads in the moeserve llama suite run: {url}")\n'


def build_model(work: Path) -> Path:
    """The tiny checkpoint every server of the run serves (built once per work directory)."""
    path = work / "base"
    if not (path / "config.json").exists():
        sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "serve")]
        from qwen_chat import save_qwen_chat_model

        tmp = work / "base.tmp"
        save_qwen_chat_model(tmp)
        tmp.rename(path)
    return path


def run_pytest(tests_dir: Path, nodes: list[str], env: dict, xml: Path) -> None:
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "not slow", "-p", "no:cacheprovider",
                    f"--junitxml={xml}", *nodes], cwd=tests_dir, env=env, check=False)


def first_line(text: str) -> str:
    """The first line that says what failed (pytest's `E  ` lines first)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln[1:].strip() for ln in lines if ln.startswith("E ")]
    return (errors or lines or [""])[0][:300]


def not_applicable(name: str, error: str) -> str | None:
    return next((why for case, err, why in NOT_APPLICABLE if re.search(case, name) and re.search(err, error)), None)


def summarize(xml: Path) -> dict:
    """A category's counts and case names from pytest's junit XML."""
    out = {"passed": [], "failed": {}, "not_applicable": {}, "skipped": {}}
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = case.get("name")
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        if problem is not None:
            line = first_line((problem.get("message") or "") + "\n" + (problem.text or ""))
            why = not_applicable(name, line)
            if why is None:
                out["failed"][name] = line
            else:
                out["not_applicable"][name] = {"reason": why, "error": line}
        elif skipped is not None:
            out["skipped"][name] = skipped.get("message") or ""
        else:
            out["passed"].append(name)
            caveat = next((why for pattern, why in CAVEATS.items() if re.search(pattern, name)), None)
            if caveat:
                out.setdefault("caveats", {})[name] = caveat
    out["counts"] = {k: len(out[k]) for k in ("passed", "failed", "not_applicable", "skipped")}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-repo", required=True, help="a llama.cpp checkout (its tools/server/tests)")
    ap.add_argument("--work", default="/tmp/llama_suite", help="the tiny checkpoint and its template copies")
    ap.add_argument("--category", action="append", choices=list(CATEGORIES), help="(default: all)")
    ap.add_argument("--out", default=None, help="summary JSON (default: bench/results/llama_suite-<time>.json)")
    args = ap.parse_args()
    tests_dir = Path(args.llama_repo).resolve() / "tools" / "server" / "tests"
    if not (tests_dir / "utils.py").exists():
        sys.exit(f"llama_suite: {tests_dir} holds no utils.py (is --llama-repo a llama.cpp checkout?)")
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    model = build_model(work)
    shim = work / "shim"
    shim.mkdir(exist_ok=True)
    (shim / "wget.py").write_text(WGET_SHIM)
    env = {**os.environ, "LLAMA_SERVER_BIN_PATH": str(ADAPTER), "LLAMA_SUITE_MODEL": str(model),
           "LLAMA_SUITE_WORK": str(work), "LLAMA_CACHE": str(work / "llama_cache"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    if importlib.util.find_spec("wget") is None:
        env["PYTHONPATH"] = str(shim) + os.pathsep + env["PYTHONPATH"]
    summary = {"llama_repo": str(Path(args.llama_repo).resolve()), "categories": {}, "out_of_scope": OUT_OF_SCOPE,
               "files": {"utils.py": hashlib.sha256((tests_dir / "utils.py").read_bytes()).hexdigest()[:12]},
               "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    for category in args.category or list(CATEGORIES):
        files = {node.split("::")[0] for node in CATEGORIES[category]}
        missing = sorted(f for f in files if not (tests_dir / f).exists())
        nodes = [n for n in CATEGORIES[category] if n.split("::")[0] not in missing]
        if not nodes:
            summary["categories"][category] = {"missing_files": missing}
            continue
        for f in sorted(files - set(missing)):
            summary["files"][f] = hashlib.sha256((tests_dir / f).read_bytes()).hexdigest()[:12]
        xml = work / f"{category}.xml"
        run_pytest(tests_dir, nodes, env, xml)
        summary["categories"][category] = {**summarize(xml), "missing_files": missing}
    totals = {k: sum(c.get("counts", {}).get(k, 0) for c in summary["categories"].values())
              for k in ("passed", "failed", "not_applicable", "skipped")}
    summary["totals"] = totals
    out = Path(args.out) if args.out else REPO / "bench" / "results" / \
        f"llama_suite-{dt.datetime.now(dt.timezone.utc):%Y%m%d-%H%M%S}.json"
    out.write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({c: v.get("counts", v) for c, v in summary["categories"].items()}), f"\ntotals {totals}\n{out}")
    return 0 if totals["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
