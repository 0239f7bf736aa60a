"""The one trainer for PR-MoE and Mixture-of-Students: staged KD's schedule, the KD loss, a tiny PR-MoE run that
learns, a student distilled from it, and the CLI commands on the saved checkpoint."""

import json

import pytest
import torch

from moeserve.cli import main as cli_main
from moeserve.errors import MoeserveError
from moeserve.model.transformer import MoETransformer
from moeserve.spec import ModelSpec
from moeserve.train.arch import architecture
from moeserve.train.distill import DistillConfig, kd_loss, kd_weight_at
from moeserve.train.loop import RouterTap, TrainConfig, init_weights, make_optimizer, train_step
from moeserve.train.run import main


def test_staged_kd_weight_stops_at_the_configured_step():
    staged = DistillConfig("teacher", weight=0.7, stop_step=5)
    assert [kd_weight_at(s, staged) for s in range(8)] == [0.7] * 5 + [0.0] * 3
    throughout = DistillConfig("teacher", weight=0.7)
    assert all(kd_weight_at(s, throughout) == 0.7 for s in (0, 5, 10_000))
    assert kd_weight_at(0, None) == 0.0
    with pytest.raises(MoeserveError, match="KD weight"):
        DistillConfig("teacher", weight=-1.0)


def test_kd_loss_is_the_kl_of_the_softened_distributions():
    g = torch.Generator().manual_seed(3)
    s, t = torch.randn(2, 5, 11, generator=g), torch.randn(2, 5, 11, generator=g)
    T = 2.0
    p_t = (t / T).softmax(-1)
    want = (p_t * (p_t.log() - (s / T).log_softmax(-1))).sum(-1).mean() * T * T
    assert kd_loss(s, t, T).item() == pytest.approx(want.item(), rel=1e-5)
    assert kd_loss(t, t, T).item() == pytest.approx(0.0, abs=1e-6)


class CountingTeacher(torch.nn.Module):
    """A teacher that counts its calls and answers fixed random logits."""

    def __init__(self, vocab: int):
        super().__init__()
        self.calls, self.vocab = 0, vocab

    def forward(self, tokens):
        self.calls += 1
        return torch.randn(*tokens.shape, self.vocab, generator=torch.Generator().manual_seed(self.calls))


def test_train_step_adds_the_kd_term_only_before_the_stop_step():
    """The loop's use of the schedule: a step before the stop computes the teacher and a KD term > 0 that moves the
    student; from the stop on the teacher is not run and the loss is the cross-entropy alone."""
    spec = ModelSpec.from_hf_config(architecture("prmoe", quick=True).hf_config(16))
    model = MoETransformer(spec)
    init_weights(model, 0.02, seed=0)
    cfg = TrainConfig()
    opt = make_optimizer(model, cfg, fused=False)
    tap, teacher = RouterTap(model), CountingTeacher(spec.vocab_size)
    staged = DistillConfig("t", weight=1.0, stop_step=2)
    batch = torch.randint(0, spec.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    no_autocast = lambda: torch.autocast("cpu", enabled=False)  # noqa: E731
    kds = [train_step(model, opt, tap, batch, 1e-3, cfg, no_autocast, teacher, kd_weight_at(s, staged))[2]
           for s in range(4)]
    assert kds[0] > 0 and kds[1] > 0 and kds[2:] == [0.0, 0.0]
    assert teacher.calls == 2


def test_tiny_prmoe_run_learns_and_a_student_distils_from_it(texts, tmp_path, capsys):
    """Seconds on a CPU: the PR-MoE loss falls; a 1-layer MoS student of it trains with staged KD through
    `moeserve train` (KD logged before the stop, zero after); the saved PR-MoE answers `moeserve generate` and
    `moeserve quantize`."""
    teacher = tmp_path / "prmoe"
    assert main(["--arch", "prmoe", "--quick", "--texts", str(texts), "--out", str(teacher), "--device", "cpu",
                 "--steps", "40", "--eval-every", "10"]) == 0
    record = json.loads((teacher / "training.json").read_text())
    history = record["history"]
    assert history[-1]["train_loss"] < history[0]["train_loss"] - 0.5
    assert history[-1]["heldout_loss"] < history[0]["heldout_loss"]
    assert json.loads((teacher / "config.json").read_text())["architectures"] == ["PRMoEForCausalLM"]
    assert record["arch"]["experts"] == [2, 4] and record["arch"]["residual"]

    student = tmp_path / "mos"
    assert cli_main(["train", "--arch", "prmoe", "--quick", "--layers", "1", "--teacher", str(teacher),
                     "--kd-stop", "10", "--texts", str(texts), "--out", str(student), "--device", "cpu",
                     "--steps", "20", "--eval-every", "5"]) == 0
    record = json.loads((student / "training.json").read_text())
    assert record["distill"]["stop_step"] == 10 and record["arch"]["experts"] == [4]
    assert [h["kd_loss"] > 0 for h in record["history"]] == [True, True, False, False]
    capsys.readouterr()

    assert cli_main(["generate", "--model", str(teacher), "--greedy", "--max-new-tokens", "8", "KING."]) == 0
    assert capsys.readouterr().out.startswith("KING.")
    quantized = tmp_path / "prmoe-4bit"
    assert cli_main(["quantize", "--model", str(teacher), "--out", str(quantized), "--bits", "4", "--group", "16",
                     "--method", "rtn"]) == 0
    assert cli_main(["eval", "ppl", "--model", str(quantized), "--window", "32", "--max-tokens", "200"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["perplexity"] < 258
