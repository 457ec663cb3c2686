"""TrainingGraph: the plain, frozen description of one training step that solvers see.

No fx.Node and no tensor lives here: only names, edges, byte counts and costs, so a graph can be
saved as JSON, built by hand in tests, and handed to any solver.

Memory model (the simulator in `remat.core.simulator` is its single judge):
  * a node's value occupies `out_bytes` from the moment the node runs until the last read of that
    computed instance (a recomputation makes a new instance); an op with several outputs may
    list them in `out_parts` (bytes, readers), and each part is then freed after the last read
    by one of its own readers;
  * `kept_bytes` are graph outputs (the loss, parameter gradients): they stay live to the end,
    except the parts listed in `forward_kept` (new values of mutated buffers, e.g. BatchNorm's
    running statistics): AOTAutograd's forward copies those into the buffers and drops them, so
    they are freed when the forward ends, or after their last backward reader if one reads them;
  * `workspace_bytes` are temporaries that exist only while the node runs;
  * `resident_bytes` (parameters, buffers, inputs, and the backward's tangents) are live
    throughout, except the `tangents`, which are created when the backward starts (the loss's seed
    gradient by autograd; zeros by AOTAutograd for outputs that get no gradient, freed after their
    last reader).
The forward ends at the first computation of the last forward node (graph order), as the runtime
splits it. Solvers that ignore `forward_kept` and `tangents` overestimate, never underestimate.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from functools import cached_property

__all__ = ["Node", "TrainingGraph", "RNG_STATE_OP"]

RNG_STATE_OP = "rng_state.default"  # the op name of a node that saves the generator state (graph_capture/rng_replay.py)


@dataclass(frozen=True)
class Node:
    name: str
    op: str  # aten op (or "group[k]" for a coarsened node), for reports
    inputs: tuple[str, ...]  # names of the nodes whose values this node reads, each once
    out_bytes: int  # bytes it allocates that are freed after the last read
    kept_bytes: int = 0  # bytes of graph outputs it allocates: live to the end of the step
    workspace_bytes: int = 0  # temporaries alive only while it runs
    cost: float = 1.0  # compute cost in FLOP-equivalents; > 0 so no recomputation is free
    flops: int = 0  # FLOPs as torch.utils.flop_counter counts them (matmul-like ops)
    is_backward: bool = False  # part of the backward pass
    is_random: bool = False  # draws random numbers: never recomputed
    module_path: str = ""  # e.g. "h.0.attn", for readable reports
    members: tuple[str, ...] = ()  # what it stands for: fx node names, or fine node names when coarse
    # separate outputs with their own readers (bytes, reader names), summing to out_bytes; empty:
    # one value that every reader reads
    out_parts: tuple[tuple[int, tuple[str, ...]], ...] = ()
    # parts of kept_bytes alive only to the end of the forward or their last reader, whichever is
    # later (bytes, reader names): new values of mutated buffers
    forward_kept: tuple[tuple[int, tuple[str, ...]], ...] = ()

    @property
    def recomputable(self) -> bool:
        """Only deterministic forward values that are not step outputs may be computed twice."""
        return not self.is_backward and not self.is_random and self.kept_bytes == 0


@dataclass(frozen=True)
class TrainingGraph:
    nodes: tuple[Node, ...]  # a topological order: forward nodes first, then backward
    resident_bytes: int  # parameters, buffers, inputs (and the tangents)
    name: str = ""
    meta: dict = field(default_factory=dict, compare=False, hash=False)  # free-form provenance
    # the backward's tangent inputs, part of resident_bytes but created when the backward starts:
    # (bytes, reader names); no readers: held to the end of the step (the loss's seed gradient)
    tangents: tuple[tuple[int, tuple[str, ...]], ...] = ()

    def __post_init__(self):
        seen: set[str] = set()
        for n in self.nodes:
            if n.name in seen:
                raise ValueError(f"duplicate node name {n.name!r}")
            for i in n.inputs:
                if i not in seen:
                    raise ValueError(f"node {n.name!r} reads {i!r}, which is not an earlier node")
            if n.out_parts and sum(b for b, _ in n.out_parts) != n.out_bytes:
                raise ValueError(f"node {n.name!r}: out_parts do not add up to out_bytes")
            if sum(b for b, _ in n.forward_kept) > n.kept_bytes:
                raise ValueError(f"node {n.name!r}: forward_kept exceeds kept_bytes")
            if n.cost <= 0:
                raise ValueError(f"node {n.name!r} has cost {n.cost}; every node must cost > 0")
            seen.add(n.name)
        if sum(b for b, _ in self.tangents) > self.resident_bytes:
            raise ValueError("tangents exceed resident_bytes")

    # ---- lookups -----------------------------------------------------------------------------
    @cached_property
    def index(self) -> dict[str, int]:
        return {n.name: i for i, n in enumerate(self.nodes)}

    def node(self, name: str) -> Node:
        return self.nodes[self.index[name]]

    @cached_property
    def users(self) -> dict[str, tuple[str, ...]]:
        out: dict[str, list[str]] = {n.name: [] for n in self.nodes}
        for n in self.nodes:
            for i in n.inputs:
                out[i].append(n.name)
        return {k: tuple(v) for k, v in out.items()}

    @cached_property
    def input_indices(self) -> tuple[tuple[int, ...], ...]:
        """Each node's inputs as node indices (the solvers build thousands of schedules of one graph)."""
        return tuple(tuple(self.index[i] for i in n.inputs) for n in self.nodes)

    @cached_property
    def recomputable_flags(self) -> tuple[bool, ...]:
        """Each node's `recomputable`, by index (a property each read: the plans' repairs read it per
        candidate and step)."""
        return tuple(n.recomputable for n in self.nodes)

    @cached_property
    def edges(self) -> tuple[tuple[str, str], ...]:
        return tuple((i, n.name) for n in self.nodes for i in n.inputs)

    @property
    def forward_nodes(self) -> tuple[Node, ...]:
        return tuple(n for n in self.nodes if not n.is_backward)

    @property
    def backward_nodes(self) -> tuple[Node, ...]:
        return tuple(n for n in self.nodes if n.is_backward)

    @property
    def total_cost(self) -> float:
        return sum(n.cost for n in self.nodes)

    @property
    def total_flops(self) -> int:
        return sum(n.flops for n in self.nodes)

    def to_networkx(self):
        import networkx as nx

        g = nx.DiGraph()
        g.add_nodes_from(n.name for n in self.nodes)
        g.add_edges_from(self.edges)
        return g

    def fingerprint(self) -> str:
        """A short hash of the structure, sizes and flags: a saved plan must match it to deploy.
        Workspace bytes are measured on the machine and are left out, so a plan made on one
        machine deploys on another (the runtime re-simulates it there); so are output storages the
        real kernels make larger than traced: for those nodes `meta["traced_bytes"]` holds the
        traced [out_bytes, kept_bytes], which are hashed instead. Likewise a graph whose bytes are
        counted as CUDA's allocator counts them (each allocation rounded up to 512 bytes) hashes
        its traced bytes (`traced_bytes`, and `meta["traced_resident_bytes"]` for the resident
        ones), so a plan made for a GPU deploys on the same graph traced on a CPU and back."""
        import hashlib

        traced = self.meta.get("traced_bytes", {})
        h = hashlib.sha256()
        for n in self.nodes:
            out_b, kept_b = traced.get(n.name, (n.out_bytes, n.kept_bytes))
            h.update(f"{n.name}|{n.op}|{n.inputs}|{out_b}|{kept_b}|"
                     f"{n.is_backward}|{n.is_random};".encode())
        h.update(str(self.meta.get("traced_resident_bytes", self.resident_bytes)).encode())
        return h.hexdigest()[:16]

    @cached_property
    def _structure_hash(self) -> str:
        import hashlib

        h = hashlib.sha256()
        for n in self.nodes:
            h.update(f"{n.name}|{n.op}|{n.inputs}|{n.is_backward}|{n.is_random};".encode())
        return h.hexdigest()[:16]

    def structure_fingerprint(self) -> str:
        """A short hash of the nodes, their ops, edges and flags, without any size: two graphs with
        the same one are the same computation at other sizes (another batch or sequence length),
        so a schedule of one runs on the other (its peak and cost must be simulated again)."""
        return self._structure_hash

    # ---- (de)serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"name": self.name, "resident_bytes": self.resident_bytes, "meta": self.meta,
                "nodes": [asdict(n) for n in self.nodes], "tangents": [list(t) for t in self.tangents]}

    @classmethod
    def from_dict(cls, d: dict) -> "TrainingGraph":
        def parts(ps) -> tuple:
            return tuple((b, tuple(r)) for b, r in ps)

        nodes = tuple(Node(**{**n, "inputs": tuple(n["inputs"]), "members": tuple(n["members"]),
                               "out_parts": parts(n.get("out_parts", ())),
                               "forward_kept": parts(n.get("forward_kept", ()))})
                      for n in d["nodes"])
        return cls(nodes=nodes, resident_bytes=d["resident_bytes"], name=d.get("name", ""),
                   meta=d.get("meta", {}), tangents=parts(d.get("tangents", ())))

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, s: str) -> "TrainingGraph":
        return cls.from_dict(json.loads(s))
