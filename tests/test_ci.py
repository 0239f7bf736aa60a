"""`.ci/run` runs the README's two commands, each in a fresh virtual environment of its own."""

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_both_readme_commands_in_their_own_fresh_venvs(tmp_path):
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    (tmp_path / "README.md").write_text("## Two commands\n\n```bash\necho first=$VIRTUAL_ENV\n```\n\n"
                                        "```bash\necho second=$VIRTUAL_ENV; exit 3\n```\n\n## Next\n")
    out = subprocess.run(["bash", str(tmp_path / ".ci" / "run")], capture_output=True, text=True, timeout=300)
    envs = dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line and not line.startswith("+"))
    assert out.returncode == 3  # the test command's failure is CI's
    assert envs["first"] and envs["second"] and envs["first"] != envs["second"]
    assert not Path(envs["first"]).exists() and not Path(envs["second"]).exists()  # each removed after its command
