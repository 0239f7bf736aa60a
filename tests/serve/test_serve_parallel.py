"""`moeserve serve` under torchrun: rank 0 serves HTTP and leads, the other rank steps the same continuous batch
(serve/mirror.py). Concurrent greedy requests over an expert-parallel (gloo, CPU) launch get the text each gets
from the single-process model alone; a client that leaves mid-stream frees its slot on both ranks and later requests
still match; both ranks end cleanly on SIGTERM (rank 0 stops the other)."""

import httpx
import pytest

from moeserve.serve.process import ServerProcess
from test_serve_placements import concurrent_texts, solo_texts
from single_thread import one_thread  # noqa: F401 - autouse fixture


@pytest.mark.parametrize("flag", ["--ep", "--tp"])
def test_serve_under_torchrun_gives_solo_texts(byte_model_dir, flag):
    want = solo_texts(str(byte_model_dir))
    with ServerProcess("--model", str(byte_model_dir), "--device", "cpu", "--threads", "1", "--parallel", "3",
                       flag, "2", ranks=2) as server:
        assert "2 ranks (rank 0 serving)" in "".join(server.log)
        assert concurrent_texts(server.url) == want  # 4 requests over 3 slots: one joins mid-run
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                          json={"prompt": "HAMLET.", "max_tokens": 200, "stream": True, "temperature": 0}) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n == 3:
                    break  # leave mid-stream: the slot is freed on every rank
        assert concurrent_texts(server.url) == want
        server.stop()  # SIGTERM to torchrun, which passes it on and then exits 1 itself (its own SignalException)
        log = "".join(server.log)
        assert "[rank" not in log and "ChildFailedError" not in log, log[-2000:]  # both ranks ended cleanly
