"""The ranks 1..t-1 of a tensor-parallel worker as Ray actors: one actor a rank, each in its own
bundle of the worker's placement group (STRICT_PACK: one node, whose shared memory the ranks'
channel lives in), or pinned to rank 0's node when the worker has no group.

A rank actor runs `rank_main` in one long call and exits when it returns (rank 0 stopped it,
or rank 0 died: the channel sees its pid gone); it is never restarted on its own: its worker
(rank 0's actor) restarts as one and starts new ranks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from workers.tp_group import RankSpec, rank_main

RANK_BUNDLE_CPUS = 0.01   # a bundle must ask for something; the cores are the host's to share


def worker_placement(tp: int, resources: dict | None = None):
    """A placement group for one TP worker: `tp` bundles packed on one node (bundle r: rank r;
    `resources` (the role's custom resources) on rank 0's bundle)."""
    from ray.util.placement_group import placement_group
    bundles = [{"CPU": RANK_BUNDLE_CPUS, **(resources or {} if r == 0 else {})}
               for r in range(tp)]
    return placement_group(bundles, strategy="STRICT_PACK")


@ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0)
class TPRank:
    """One rank of a TP worker (not rank 0)."""

    def pid(self) -> int:
        return os.getpid()

    def run(self, spec: RankSpec) -> None:
        try:
            rank_main(spec)
        finally:
            ray.actor.exit_actor()


@dataclass(frozen=True)
class RankActor:
    """A started rank: its actor and its process id (asked before its loop took the actor)."""

    actor: Any
    pid: int


def start_rank_actors(specs: list[RankSpec], placement=None) -> list[RankActor]:
    """Start ranks 1..t-1 (their `run` calls go on in the background: their loops)."""
    node = ray.get_runtime_context().get_node_id()
    actors, pids = [], []
    for spec in specs:
        strategy = NodeAffinitySchedulingStrategy(node, soft=False) if placement is None \
            else PlacementGroupSchedulingStrategy(placement,
                                                  placement_group_bundle_index=spec.rank)
        a = TPRank.options(scheduling_strategy=strategy).remote()
        pids.append(a.pid.remote())     # before `run`, which holds the actor from then on
        a.run.remote(spec)
        actors.append(a)
    return [RankActor(a, pid) for a, pid in zip(actors, ray.get(pids, timeout=120),
                                                strict=True)]


def stop_rank_actor(rank: RankActor) -> None:
    """A rank that did not stop on rank 0's message (or could not get it) is killed."""
    try:
        ray.kill(rank.actor, no_restart=True)
    except Exception:   # noqa: BLE001 - already gone
        pass
