"""Stage one over several nodes: how the nodes of one curation find each other's shards through files in
``curate/shards/`` of the shared OUTPUT_DIR (``stages.curate.curate`` runs it when ``NNODES`` > 1).

Node 0 starts the run (``run.json``) and merges every shard's record; each node keeps a state file with a heartbeat
counter, by which the others tell a live node from a dead one (``NodeWatch``) without comparing clocks. The
waits' limits come from the environment: ``OPD_NODE_SKEW_S``, ``OPD_NODE_STALL_S``, ``OPD_NODE_HEARTBEAT_S``,
``OPD_SHARD_GRACE_S``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import threading
import time
import uuid
from pathlib import Path

from data_tools.runio import write_json


def shard_path(out: Path, shard: int, shards: int) -> Path:
    """The record of shard ``shard`` of ``shards`` under a curation's directory ``out``."""
    return out / "shards" / f"shard-{shard}-of-{shards}.json"


def read_json(path: Path) -> dict | None:
    """The JSON object in ``path``, or None when it is missing or half-written."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class ShardFailed(RuntimeError):
    """Another node's shards failed or stopped reporting; the message is one line naming the node."""


def env_s(name: str, default: float) -> float:
    """Seconds from the environment variable ``name``, else ``default``."""
    return float(os.environ.get(name) or default)


class Node:
    """This node's part in a run over several nodes, through files in ``curate/shards/`` of the shared OUTPUT_DIR.

    Node 0 is the run's authority: at its start it clears ``shards/`` (an earlier run's records) and writes
    ``run.json`` with a fresh run id; the other nodes adopt the id of a ``run.json`` of their curation written
    at most ``OPD_NODE_SKEW_S`` (600 s) before their own start, and keep watching it, so a node that took an
    earlier run's id moves to the new one (and re-writes its records under it). Every node keeps a state
    file ``node-<r>.json`` (run id, state, a counter bumped every ``OPD_NODE_HEARTBEAT_S``, 10 s), by which
    the others tell a live node from a dead one without comparing clocks.
    """

    def __init__(self, out: Path, fingerprint: str, rank: int, t_start: float):
        self.out, self.fingerprint, self.rank, self.dir = out, fingerprint, rank, out / "shards"
        self.state, self.error, self.seq = "measuring", None, 0
        self.records: dict[int, dict] = {}  # this node's finished shards
        self._lock = threading.RLock()
        self._stop = threading.Event()
        if rank == 0:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir.mkdir(parents=True)
            self.run_id = f"{fingerprint}-{uuid.uuid4().hex[:12]}"
            write_json({"run_id": self.run_id, "fingerprint": fingerprint, "time": time.time(),
                        "host": socket.gethostname()}, self.dir / "run.json")
        else:
            self.run_id = self._await_run_id(t_start)
        self._beat()
        self._thread = threading.Thread(target=self._run, daemon=True, name="opd-node-heartbeat")
        self._thread.start()

    def _current(self, since: float) -> str | None:
        rec = read_json(self.dir / "run.json")
        if rec and rec.get("fingerprint") == self.fingerprint and rec.get("time", 0) >= since:
            return rec.get("run_id")
        return None

    def _await_run_id(self, t_start: float) -> str:
        skew, stall = env_s("OPD_NODE_SKEW_S", 600), env_s("OPD_NODE_STALL_S", 300)
        said, t0 = False, time.monotonic()
        while (run_id := self._current(t_start - skew)) is None:
            if time.monotonic() - t0 > stall:
                raise ShardFailed(f"node 0 (NODE_RANK=0) did not start this run's stage one within {stall:.0f}s: "
                                  f"no {self.dir / 'run.json'} of this curation")
            if not said:
                print("[curate] waiting for node 0 to start the run (its shards/run.json)", flush=True)
                said = True
            time.sleep(1.0)
        return run_id

    def _beat(self) -> None:
        with self._lock:
            self.seq += 1
            write_json({"run_id": self.run_id, "node": self.rank, "host": socket.gethostname(), "pid": os.getpid(),
                        "state": self.state, "error": self.error, "seq": self.seq, "time": time.time()},
                       self.dir / f"node-{self.rank}.json")

    def _run(self) -> None:
        every = env_s("OPD_NODE_HEARTBEAT_S", 10)
        while not self._stop.wait(every):
            with contextlib.suppress(OSError, ValueError):
                if self.rank and (new := self._current(0.0)) and new != self.run_id:  # node 0 started a newer run
                    with self._lock:
                        self.run_id = new
                        for g, rec in self.records.items():
                            self.record(g, rec)
                self._beat()

    def record(self, shard: int, rec: dict) -> None:
        """Write this node's record of ``shard`` under the current run id (again after an adoption)."""
        with self._lock:
            self.records[shard] = rec
            write_json(rec | {"run_id": self.run_id}, shard_path(self.out, shard, rec["shards"]))

    def set(self, state: str, error: str | None = None) -> None:
        self.state, self.error = state, error
        with contextlib.suppress(OSError):
            self._beat()

    def stop(self) -> None:
        self._stop.set()


class NodeWatch:
    """Another node's state file, seen from here: raises :class:`ShardFailed` when it failed, or when its file
    has not changed for ``OPD_NODE_STALL_S`` (300 s) by this node's clock (no clock skew matters)."""

    def __init__(self, shards_dir: Path):
        self.dir, self.stall_s = shards_dir, env_s("OPD_NODE_STALL_S", 300)
        self.seen: dict[int, tuple[str | None, float]] = {}

    def check(self, node: int, run_id: str, what: str) -> None:
        hb = read_json(self.dir / f"node-{node}.json")
        if hb is not None and hb.get("run_id") != run_id:
            hb = None  # an earlier run's file
        if hb is not None and hb.get("state") == "failed":
            raise ShardFailed(f"node {node} (NODE_RANK={node}, {hb.get('host')}) failed: {hb.get('error')}")
        key = None if hb is None else str(hb.get("seq"))
        last = self.seen.get(node)
        now = time.monotonic()
        if last is None or last[0] != key:
            self.seen[node] = (key, now)
        elif now - last[1] > self.stall_s:
            how = "never reported" if key is None else f"stopped reporting (last state: {hb.get('state')})"
            raise ShardFailed(f"node {node} (NODE_RANK={node}) {how} for {now - last[1]:.0f}s while {what}; "
                              f"its state file: {self.dir / f'node-{node}.json'}")


def await_shards(out: Path, workers: int, shards: int, run_id: str, deadline: float | None,
                 ) -> tuple[list[dict], list[int]]:
    """Node rank 0: the records of every shard of this run, waiting for other nodes' shards; after the
    budget's end plus ``OPD_SHARD_GRACE_S`` (300 s) it returns without the missing ones."""
    grace = env_s("OPD_SHARD_GRACE_S", 300)
    watch = NodeWatch(out / "shards")
    said = False
    while True:
        recs = {g: r for g in range(shards)
                if (r := read_json(shard_path(out, g, shards))) is not None and r.get("run_id") == run_id}
        missing = [g for g in range(shards) if g not in recs]
        if not missing:
            return [recs[g] for g in range(shards)], []
        if local := [g for g in missing if g < workers]:  # node 0's own shards are over: their records must be there
            raise ShardFailed(f"shard(s) {local} of this node ended without writing their record "
                              f"({shard_path(out, local[0], shards)})")
        for node in sorted({g // workers for g in missing}):
            watch.check(node, run_id, f"node 0 waits for its shards {[g for g in missing if g // workers == node]}")
        if deadline is not None and time.time() > deadline + grace:
            print(f"[curate] the budget ended {time.time() - deadline:.0f}s ago: merging without shard(s) {missing}",
                  flush=True)
            return [recs[g] for g in sorted(recs)], missing
        if not said:
            print(f"[curate] node 0: waiting for shard(s) {missing} of the other node(s)", flush=True)
            said = True
        time.sleep(1.0)


def await_manifest(out: Path, node: Node) -> dict:
    """Node rank > 0: wait for node 0's merged manifest of this run (the curriculum every node trains on)."""
    watch = NodeWatch(out / "shards")
    print("[curate] waiting for node 0 to merge the shards into the curriculum", flush=True)
    while True:
        m = read_json(out / "manifest.json")
        if m is not None and m.get("run_id") == node.run_id:
            print(f"[curate] node 0 merged the curriculum: {m['counts']['curriculum']} rows in "
                  f"{out / 'curriculum.parquet'}", flush=True)
            return m
        watch.check(0, node.run_id, "this node waits for the merged curriculum")
        time.sleep(1.0)


__all__ = ["Node", "NodeWatch", "ShardFailed", "await_manifest", "await_shards", "env_s", "read_json", "shard_path"]
