"""The ``gnnpar`` command's launch agent forked before the command's work
(:class:`gnnpar.launch.ForkedAgent`): a launch through it hands the ranks the environment and
thread count a new interpreter would have had, reports a failed rank's exit code, and an
agent that was not used exits; a process already running other threads does not fork."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from gnnpar.launch import ForkedAgent, _forks
from gnnpar.train.loop import BaseTask

ROOT = Path(__file__).resolve().parents[1]

RANK = """
import json, os, signal, sys
import torch
rank = int(os.environ["RANK"])
os.kill(os.getpid(), signal.SIGUSR1)  # prints this rank's stack (and kills it without a handler)
agent = os.getppid()
with open(f"/proc/{agent}/stat") as f:
    caller = int(f.read().rsplit(")", 1)[1].split()[1])
with open(f"/proc/{agent}/cmdline", "rb") as f:
    agent_cmdline = f.read().decode()
Path = __import__("pathlib").Path
Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps({
    "threads": torch.get_num_threads(), "probe": os.environ.get("PROBE"),
    "caller": caller, "agent_cmdline": agent_cmdline,
}))
sys.exit(3 if rank == 1 else 0)
"""

CALLER = """
import json, os, sys
from gnnpar.launch import ForkedAgent, launch_local
unused = ForkedAgent.start()
unused.close()
agent = ForkedAgent.start()
code = launch_local(2, [sys.argv[1]], script="rank.py", env={"PROBE": "yes"}, agent=agent)
print(json.dumps({"me": os.getpid(), "code": code, "unused": unused.pid,
                  "unused_gone": not os.path.exists(f"/proc/{unused.pid}"),
                  "cmdline": open("/proc/self/cmdline", "rb").read().decode()}))
"""


@pytest.mark.skipif(not _forks(), reason="ranks are not forked here (no Linux fork, or a GPU)")
def test_a_launch_in_the_forked_agent_sets_up_the_ranks_like_a_new_interpreter(tmp_path):
    (tmp_path / "rank.py").write_text(RANK)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "RANK")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, "-c", CALLER, str(tmp_path)], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    caller = json.loads(proc.stdout.strip().splitlines()[-1])
    assert caller["code"] == 3, proc.stderr  # rank 1's own exit code, as from a new agent
    assert "rank 1 of 2 exited with status 3" in proc.stderr
    assert caller["unused_gone"], "the agent that was not used is still running"
    # kill -USR1 printed each rank's stack, and the ranks went on (run_rank's handler)
    assert proc.stderr.count("(most recent call first)") >= 2, proc.stderr
    # the thread count launch_local gives each rank (torch's default here is every core)
    threads = max(1, (os.cpu_count() or 1) // 2)
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["probe"] == "yes"
        assert got["threads"] == threads, got
        # the ranks' agent is a fork of the caller, not a new interpreter
        assert got["caller"] == caller["me"]
        assert got["agent_cmdline"] == caller["cmdline"]


def test_a_process_running_other_threads_does_not_fork_an_agent():
    release = threading.Event()
    other = threading.Thread(target=release.wait)
    other.start()
    try:
        agent = ForkedAgent.start()
        if agent is not None:  # a wrong fork: let it go before failing
            agent.close()
        assert agent is None
    finally:
        release.set()
        other.join()


def _session_processes(sid: int) -> list[int]:
    """The live processes of session ``sid`` (the command, its agent and its ranks)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                out.append(int(entry.name))
    return out


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc to find the processes")
@pytest.mark.parametrize(
    "entry",
    [["-m", "gnnpar.cli"], ["-c", "import sys; from gnnpar.cli import main; sys.exit(main())"]],
    ids=["forked-agent", "agent-interpreter"],
)
def test_ctrl_c_stops_the_ranks_with_one_line(tmp_path, entry):
    """Ctrl-C (SIGINT to the terminal's process group) in a local launch: the agent stops the
    ranks and says so; the command adds no second line, exits 130 and leaves no process."""
    import signal
    import time

    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("OMP_NUM_THREADS", None)
    argv = [sys.executable, *entry, "train", "gcn", "--dataset", "sbm", "--root",
            str(tmp_path / "data"), "--epochs", "100000", "--eval-every", "0", "--nprocs", "2",
            "--out", str(out)]  # fmt: skip
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        metrics = out / "metrics.jsonl"
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the run did not start training: {proc.communicate()[1][-2000:]}")
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    said = [line for line in err.splitlines() if "interrupt" in line]
    assert proc.returncode == 130, err[-2000:]
    assert said == ["gnnpar train: interrupted by SIGINT; the ranks were stopped"], err[-2000:]
    assert "Traceback" not in err
    assert _session_processes(proc.pid) == []


class _InterruptedTask(BaseTask):
    """A task whose step ``at`` is interrupted (Ctrl-C reaching a rank)."""

    unit = "step"

    def __init__(self, grid, at: int):
        import torch

        self.grid, self.num_steps, self.at = grid, 10, at
        self.model = torch.nn.Linear(1, 1)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def train_step(self, step: int) -> dict[str, float]:
        if step == self.at:
            raise KeyboardInterrupt
        return {"loss": float(step)}

    def describe(self) -> dict:
        return {"task": "interrupted"}


def test_an_interrupted_run_closes_its_bar_on_the_way_out(tmp_path, monkeypatch):
    """The trainer closes its progress bar while the interrupt leaves the run, not in the bar's
    finaliser at exit (where the second SIGINT a rank gets printed a traceback)."""
    import gnnpar
    from gnnpar.train import progress
    from gnnpar.train.loop import Trainer

    closed = []
    close = progress._Bar.close
    monkeypatch.setattr(progress._Bar, "close", lambda bar: (closed.append(bar), close(bar))[1])
    trainer = Trainer(_InterruptedTask(gnnpar.init(), at=2), tmp_path, eval_every=0, quiet=True)
    with pytest.raises(KeyboardInterrupt) as caught:
        trainer.run()
    assert len(closed) == 1  # while `caught` still holds the run's frames (and its bar)
    assert caught.value is not None


def test_a_ranks_second_interrupt_during_the_clean_up_is_ignored(monkeypatch, capsys):
    """A rank gets Ctrl-C twice: from the terminal and from the launcher stopping it. The
    second one, arriving while the command cleans up, changes nothing: exit 130, and no line
    (the launcher speaks for the ranks)."""
    import signal
    import time

    from gnnpar.cli import top as cli

    def interrupt() -> None:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # the handler runs between bytecodes: let it

    def interrupted(args):
        interrupt()  # the terminal's Ctrl-C
        pytest.fail("the first interrupt did not stop the command")

    monkeypatch.setattr(cli, "_a_rank", lambda: True)
    monkeypatch.setattr(cli, "_cmd_info", interrupted)
    monkeypatch.setattr(cli, "_release_distributed", interrupt)  # the launcher's, late
    handler = signal.getsignal(signal.SIGINT)
    try:
        code = cli.main(["info"])
    except KeyboardInterrupt:
        pytest.fail("the second interrupt escaped the command's clean-up")
    finally:
        signal.signal(signal.SIGINT, handler)
    assert code == 130
    assert capsys.readouterr().err == ""
