"""Stage two over several processes: accelerate's launcher (torchrun underneath), a failure told in one line.

    python -m stages.launch --num_processes 8 -- --config configs/opd_r1_distill_1p5b.yaml [--field value ...]
    python -m stages.launch --num_processes 16 --num_machines 2 --machine_rank 1 --main_process_ip HOST \
        --main_process_port 29500 -- --config ...            # one command a node, torchrun's static rendezvous

``run.sh`` calls it when a run has more than one training process. Everything before ``--`` goes to
``accelerate launch`` (with ``configs/accelerate/ddp.yaml``: one process a GPU, DDP); everything after it to
``stages.train``, which every process runs. The processes are this one's children: ``run.sh`` hands a SIGTERM
to them (each finishes its step, then they save once together), not to the launcher, which would kill them
``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds later.

When a process fails, torchrun stops the others (SIGTERM, then SIGKILL after 30 s: a process waiting at a
collective for the dead one never returns by itself, so nobody hangs) and this prints one line naming the
first to fail, its exit code and the pid, then exits with that code (2 bad configuration, 74 disk full, 75
locked, ... as ``stages.train``), instead of the launcher's page of traceback.
"""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path

from accelerate.commands.launch import launch_command, launch_command_parser
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

DDP_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "accelerate" / "ddp.yaml"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: python -m stages.launch [accelerate launch options] -- [stages.train options]"
    if argv in (["-h"], ["--help"]):  # asked for: the usage and this module's text, exit 0
        print(f"{usage}\n\n{__doc__.strip()}\n\nthe launcher's options: accelerate launch --help; the training "
              "options: python -m stages.train --help")
        return 0
    if "--" not in argv:
        print(f"opd launch: {usage}", file=sys.stderr)
        return 2
    cut = argv.index("--")
    launcher, train = argv[:cut], argv[cut + 1 :]
    # the agent's own per-process error lines repeat what the line below says
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    args = launch_command_parser().parse_args(
        ["--config_file", str(DDP_CONFIG), *launcher, "-m", "stages.train", *train])
    try:
        launch_command(args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        others = len(e.failures) - 1
        print(f"opd launch: training process rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) {how} "
              f"first{f'; {others} more failed after it' if others else ''}; the launcher stopped the rest; the "
              f"exports written so far are kept", file=sys.stderr, flush=True)
        return code if code > 0 else 128 - code
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
