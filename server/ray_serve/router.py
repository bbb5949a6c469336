"""The Ray Serve request router of the engine replicas (server/ray_serve/__init__.py): the
data-parallel router's rule across replicas, with the routing keys the ingress computed
(server/ray_serve/routing.py says what they are and where the router runs).

Ray pickles a custom router's module by value (RequestRouterConfig) and loads that copy beside
each caller of the handle: a class defined here would be another class there than the one the
ingress builds its requests from. So this module holds the router alone; the requests' types and
the routing state are imported from server/ray_serve/routing.py, by reference.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pagedserve.engine.frontend.data_parallel import DEFAULT_PREFIX_BLOCKS
from pagedserve.server.ray_serve.routing import AffinityTable, ForwardedRequest, RoutingKey


def _key_of(pending_request: PendingRequest | None) -> RoutingKey:
    if pending_request is not None and pending_request.args:
        first = pending_request.args[0]
        if isinstance(first, ForwardedRequest):
            return first.key
    return RoutingKey()  # a handle call of another method: only the load counts


class PrefixAffinityRouter(RequestRouter):
    """Ray Serve's request router for the engine replicas: the rule of this module's docstring,
    over the replicas Ray offers (a replica at its max_ongoing_requests is skipped by Ray, which
    then takes the next in the ranking)."""

    def initialize_state(self, max_chunks: int = DEFAULT_PREFIX_BLOCKS) -> None:
        self.table = AffinityTable(max_chunks)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        key = _key_of(pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if key.replica in by_id:
            return [[by_id[key.replica]]]
        # A pin to a replica that is gone falls back to the rule: the response header says
        # which replica answered.
        return [[by_id[r]] for r in self.table.rank(sorted(by_id), key.hashes)]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        key = _key_of(pending_request)
        request_id = pending_request.metadata.internal_request_id
        self.table.routed(replica_id.unique_id, request_id, key.hashes, key.cost)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.table.completed(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.table.forget(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        gone = self._replica_id_set - {r.replica_id for r in replicas}
        super().update_replicas(replicas)
        for replica_id in gone:
            self.table.forget(replica_id.unique_id)
