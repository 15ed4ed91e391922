"""bench-fleet_scale: the drafters' weights combined by a ring all-reduce (drafter.allreduce) at
N = 8, 16, 32, 64 drafter processes on loopback.

Each drafter process holds tensors of the debug drafter's trainable shapes (Eagle, fp32) and runs
`Combiner.round` with synthetic work (a seeded perturbation of its parameters and a work figure;
a quarter of the ranks report no work); there is no target. Processes are forked from this one
after torch is imported (one copy of torch's pages, shared); the TCPStore lives in a process of
its own, so any drafter can be killed.

round_s_by_n                    median over ranks and steady rounds of one round's duration
max_rank_bytes_per_round_by_n   measured: the largest per-rank median, over steady rounds, of the
                                bytes a drafter process passed to write(2)/writev(2) during
                                `round` (/proc/self/io wchar: gloo's sockets and the store client;
                                the workers write no files); computed_ring_bytes_by_n is the
                                formula 2 (N - 1) / N x model bytes, for comparison
bytes_growth_64_vs_8            max_rank_bytes at the largest N / at N = 8 (goal <= 1.25)
round_s_64_with_8_killed        the round in which 1/8 of the ranks are SIGKILLed as it starts:
                                the longest survivor's duration (goal <= 2 x combine_every_s)
rejoined_fraction               the killed ranks restarted (new processes): the fraction whose
                                first round ends with the survivors' version and parameters
combined_lost                   work seconds credited to their contributors minus the work the
                                newest version holds (goal 0)

Run: python -m bench.fleet_scale [--quick]   (make bench-fleet_scale [QUICK=1])
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import statistics
import time
from typing import Any

import torch

from bench.common import parse_args, print_table, write_results
from spectrain_api.config import model_config
from spectrain_workloads.drafter.allreduce import Combiner, start_store
from spectrain_workloads.drafter.models import build_drafter
from spectrain_workloads.drafter.settings import DrafterSettings

COMBINE_EVERY_S = 10.0           # the product's default combineEverySeconds
TIMEOUT_S = COMBINE_EVERY_S      # a collective's bound: a round with a dead member <= ~2 x this
RENDEZVOUS_S = 2.0
REPLY_S = 120.0                  # the parent's bound on any one reply


def shapes() -> dict[str, tuple[int, ...]]:
    d = build_drafter(DrafterSettings(), model_config("debug", {}, vocab_size=264))
    return {n: tuple(p.shape) for n, p in d.named_parameters() if p.requires_grad}


def wchar() -> int:
    for line in open("/proc/self/io"):
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise RuntimeError("no wchar in /proc/self/io")


def store_host(conn: Any) -> None:
    store = start_store("127.0.0.1", 0)
    conn.send(store.port)
    conn.recv()                  # held until the parent is done with this N


def drafter(rank: int, world: int, port: int, shp: dict[str, tuple[int, ...]], conn: Any) -> None:
    torch.set_num_threads(1)
    c = Combiner(rank, world, ("127.0.0.1", port), TIMEOUT_S, rendezvous_s=RENDEZVOUS_S)
    params = {n: torch.zeros(s) for n, s in shp.items()}
    credited = 0.0
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            c.close()
            conn.send(("stopped", credited))
            return
        if msg[0] == "join":
            c.join()
            conn.send(("joined",))
            continue
        _, rnd, work_s = msg
        g = torch.Generator().manual_seed(rank * 1000 + rnd)
        for p in params.values():                  # "training": progress of this round
            p.add_(torch.randn(p.shape, generator=g), alpha=0.01 * (work_s > 0))
        w0, t0 = wchar(), time.monotonic()
        res = c.round(params, work_s)
        dt, sent = time.monotonic() - t0, wchar() - w0
        if res is not None:
            params = {n: t.clone() for n, t in res.params.items()}   # synchronous: nothing to keep
            credited += res.credited_s
        conn.send(("done", {"rank": rank, "t": dt, "bytes": sent, "version": c.version, "members": c.size,
                            "work_total_s": c.work_total_s, "credited": credited, "round_id": c.round_id,
                            "checksum": float(sum(float(p.double().sum()) for p in params.values()))}))


class Fleet:
    def __init__(self, n: int, shp: dict[str, tuple[int, ...]]) -> None:
        self.ctx = mp.get_context("fork")
        self.n, self.shp = n, shp
        self.host_conn, child = self.ctx.Pipe()
        self.host = self.ctx.Process(target=store_host, args=(child,), daemon=True)
        self.host.start()
        self.port = self.host_conn.recv()
        self.procs: dict[int, Any] = {}
        self.conns: dict[int, Any] = {}
        self.credited_dead = 0.0
        for r in range(n):
            self.start(r)

    def start(self, rank: int) -> None:
        parent, child = self.ctx.Pipe()
        p = self.ctx.Process(target=drafter, args=(rank, self.n, self.port, self.shp, child), daemon=True)
        p.start()
        self.procs[rank], self.conns[rank] = p, parent

    def reply(self, rank: int) -> Any:
        if not self.conns[rank].poll(REPLY_S):
            raise SystemExit(f"drafter {rank} did not answer within {REPLY_S} s")
        return self.conns[rank].recv()

    def round(self, rnd: int, ranks: list[int] | None = None) -> dict[int, dict[str, Any]]:
        ranks = sorted(self.procs) if ranks is None else ranks
        for r in ranks:
            self.conns[r].send(("round", rnd, work(r, rnd)))
        return {r: self.reply(r)[1] for r in ranks}

    def kill(self, ranks: list[int], last: dict[int, dict[str, Any]]) -> None:
        for r in ranks:
            os.kill(self.procs[r].pid, signal.SIGKILL)
            self.procs[r].join(30)
            del self.procs[r], self.conns[r]
            self.credited_dead += last[r]["credited"]    # what it had been credited before it died

    def close(self) -> float:
        credited = self.credited_dead
        for r in sorted(self.procs):
            self.conns[r].send(("stop",))
        for r in sorted(self.procs):
            credited += self.reply(r)[1]
            self.procs[r].join(30)
        self.host_conn.send("stop")
        self.host.join(30)
        return credited


def work(rank: int, rnd: int) -> float:
    """Synthetic window work: a quarter of the ranks (every 4th) have none this round."""
    return 0.0 if (rank + rnd) % 4 == 0 else 1.0 + 0.1 * (rank % 7)


def steady(n: int, rounds: int, shp: dict[str, tuple[int, ...]], kill: bool) -> dict[str, Any]:
    f = Fleet(n, shp)
    out: dict[str, Any] = {}
    try:
        t0 = time.monotonic()
        first = f.round(0)                      # forms the group (rendezvous, gloo connections)
        out["form_s"] = time.monotonic() - t0
        per_rank_t: list[float] = []
        per_rank_bytes: dict[int, list[int]] = {r: [] for r in range(n)}
        last = first
        for i in range(1, rounds + 1):
            last = f.round(i)
            assert len({v["version"] for v in last.values()}) == 1, "members disagree on the version"
            for r, v in last.items():
                per_rank_t.append(v["t"])
                per_rank_bytes[r].append(v["bytes"])
        out["round_s"] = statistics.median(per_rank_t)
        out["max_rank_bytes"] = max(statistics.median(b) for b in per_rank_bytes.values())
        if kill:
            out.update(kill_and_rejoin(f, n, rounds + 1, last))
    finally:
        credited = f.close()
    if kill:
        out["combined_lost"] = credited - out.pop("work_total_s")
    return out


def kill_and_rejoin(f: Fleet, n: int, rnd: int, last: dict[int, dict[str, Any]]) -> dict[str, Any]:
    victims = list(range(3, n, 8))[: n // 8]    # one per 8 ranks, spread over the ring
    survivors = [r for r in range(n) if r not in victims]
    for r in range(n):
        f.conns[r].send(("round", rnd, work(r, rnd)))
    f.kill(victims, last)                      # the others are in the round's first collective
    done = {r: f.reply(r)[1] for r in survivors}
    killed_s = max(v["t"] for v in done.values())
    for r in victims:
        f.start(r)
        f.conns[r].send(("join",))
    for r in victims:
        assert f.reply(r)[0] == "joined"
    for r in victims:                          # the new processes: no work yet, their first round
        f.conns[r].send(("round", rnd + 1, 0.0))
    both = f.round(rnd + 1, survivors)
    both.update({r: f.reply(r)[1] for r in victims})
    ref = both[survivors[0]]
    rejoined = [r for r in victims if both[r]["version"] == ref["version"] and both[r]["round_id"] == ref["round_id"]
                and abs(both[r]["checksum"] - ref["checksum"]) <= 1e-6 * max(1.0, abs(ref["checksum"]))]
    after = f.round(rnd + 2)                   # everyone in one group again
    return {"round_s_with_kill": killed_s, "members_after_kill": done[survivors[0]]["members"],
            "rejoined_fraction": len(rejoined) / len(victims), "members_after_rejoin": after[0]["members"],
            "work_total_s": after[0]["work_total_s"]}


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    torch.set_num_threads(1)
    shp = shapes()
    model_bytes = sum(4 * int(torch.Size(s).numel()) for s in shp.values())
    ns, rounds = ((8, 16, 32, 64), 3) if args.quick else ((8, 16, 32, 64), 8)
    runs: dict[int, dict[str, Any]] = {}
    for n in ns:
        t0 = time.monotonic()
        runs[n] = steady(n, rounds, shp, kill=n == ns[-1])
        print(f"  N={n}: round {runs[n]['round_s']:.3f} s, {runs[n]['max_rank_bytes'] / 1e3:.0f} kB/rank, "
              f"formed in {runs[n]['form_s']:.1f} s, {time.monotonic() - t0:.0f} s in all", flush=True)
    big = runs[ns[-1]]
    keys = {
        "round_s_by_n": {str(n): r["round_s"] for n, r in runs.items()},
        "max_rank_bytes_per_round_by_n": {str(n): r["max_rank_bytes"] for n, r in runs.items()},
        "computed_ring_bytes_by_n": {str(n): 2 * (n - 1) / n * model_bytes for n in ns},
        "form_s_by_n": {str(n): r["form_s"] for n, r in runs.items()},
        "bytes_growth_64_vs_8": big["max_rank_bytes"] / runs[8]["max_rank_bytes"],
        f"round_s_{ns[-1]}_with_{ns[-1] // 8}_killed": big["round_s_with_kill"],
        "rejoined_fraction": big["rejoined_fraction"],
        "combined_lost": round(big["combined_lost"], 9) + 0.0,   # float sums in another order: 1e-13; no -0.0
        "members_after_kill": big["members_after_kill"],
        "members_after_rejoin": big["members_after_rejoin"],
        "model_bytes": model_bytes,
        "combine_every_s": COMBINE_EVERY_S, "timeout_s": TIMEOUT_S, "rendezvous_s": RENDEZVOUS_S,
        "rounds": rounds, "largest_n": ns[-1], "load_avg_1m": os.getloadavg()[0],
    }
    goals = {"bytes_growth_64_vs_8": keys["bytes_growth_64_vs_8"] <= 1.25,
             "round_s_with_kill": big["round_s_with_kill"] <= 2 * COMBINE_EVERY_S,
             "rejoined_fraction": keys["rejoined_fraction"] >= 1.0,
             "combined_lost": abs(keys["combined_lost"]) < 1e-6}
    print_table("bench-fleet_scale (ring all-reduce, debug drafter, loopback)",
                [(k, v) for k, v in keys.items() if not isinstance(v, dict)])
    for k, v in keys.items():
        if isinstance(v, dict):
            print(f"{k}: {v}")
    print_table("goals met", goals)
    write_results("fleet_scale", {**keys, "goals_met": goals}, args.quick)


if __name__ == "__main__":
    main()
