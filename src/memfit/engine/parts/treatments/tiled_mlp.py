"""``tiled_mlp``: the block runs once, but its gated MLP runs in chunks of tokens and keeps only its input.

# NOTE [Tiled MLP]
A gated MLP (``down_proj(act_fn(gate_proj(x)) * up_proj(x))``, or Phi-3's halved ``gate_up_proj``:
found as ``elementwise`` finds it, :func:`elementwise_parts`) makes four or five ``tokens x
intermediate`` tensors, which a kept block saves and which a recomputed block makes again, all at
once, in backward: for a long sequence the largest tensors of a step. Tiled, the MLP runs through
one ``torch.autograd.Function`` (:class:`_TiledMlpFunction`) that saves only its input. Its forward
runs the MLP's own forward on each chunk of tokens under ``no_grad`` (one chunk's intermediates
alive at a time) and writes each chunk's output into one output tensor; its backward runs each chunk
again with grad and ``torch.autograd.grad`` on (the chunk's input, the MLP's trainable parameters).
The rules:

* The MLP's trainable parameters are inputs of the Function: autograd accumulates each one's
  gradient once, as for an untiled MLP (DDP's hook fires once per parameter); nothing writes
  ``.grad`` aside. Per-chunk parameter gradients are summed in float32 and cast once (a chunk's
  gradient is a partial sum: float32 keeps the chunks' sum as close to the whole's as the whole's
  own rounding). So gradients are ``keep``'s within float32 rounding where there are several
  chunks (the sums reorder, and a matmul of a chunk may block its sum differently). One chunk's
  gradients are returned as they come, with no sum: bit for bit ``keep``'s, and the MLP's backward
  holds what an untiled one does. Several chunks' float32 sums live through the MLP's backward: for
  full fine-tuning in bf16 twice the MLP's weight bytes (a LoRA's adapters are small), beside one
  chunk's gradients.
* The RNG state (CPU, and the input's CUDA device) and the autocast state of the forward are
  restored for the backward's chunks, as ``torch.utils.checkpoint`` restores them: chunks run again
  in the forward's order draw the forward's numbers.
* An MLP with a dropout module of ``p > 0`` inside (a LoRA dropout) is not tiled: its chunks would
  draw their masks chunk by chunk, not as one tensor, so the masks (though consistent between the
  forward and its recompute) would not be ``keep``'s, and memfit's rule is that every plan gives the
  gradients of training without it (design: gradients equal under any plan). Such an MLP runs as it
  is under these treatments, and the probe offers them only to blocks that tile something. A dropout
  called functionally inside an MLP's forward is caught by the probe's comparison (below).
* Nothing is assumed of the MLP but that it is token-wise (each token's output depends on its own
  input only): the probe runs the block tiled in chunks that split every sequence and untiled on the
  same inputs and RNG state and offers the treatment only where their outputs agree within the dtype's rounding.
* Nor that the MLP's input has no other use, which one chunk's bit-for-bit gradients need: the Function
  returns that input's gradient summed over the MLP's own uses (gate and up), which autograd then adds to
  another use's (a post-norm block's residual: Exaone 4, OLMo 2 and 3; a mixture's router and shared-expert
  gate: Qwen2-MoE, Qwen3-Next) in another order than the untiled graph's, a float32 rounding apart in
  every gradient before the block (the rule of NOTE [Lean inputs in a tiled block]: the Function's node
  takes the place of the MLP's first nodes, which keeps the order only where the MLP uses its input once,
  as Phi-3's fused ``gate_up_proj`` does, or is its one consumer, as a pre-norm block's MLP is; or where
  autograd happens to sum the MLP's own uses first, as in Cohere's parallel block). A block's first probe
  reads the first two cases from a plain forward's autograd graph (the edges to the MLP's input from inside
  the MLP and from outside) and keeps the verdict on the block (``Block.tiles_exactly``), and warm-up hands it on
  to the blocks of its group (``probe_warmup``: a floor plan runs every block tiled). Where neither holds,
  every probe compares the block tiled in one chunk with the plain block, outputs and gradients bit for bit,
  under random output gradients (``runs_as_plain``, elementwise.py; ones are a special case: through a
  router's softmax their gradient is about zero, and a sum with a zero hides the order),
  and one difference ends the treatments for the block: nothing of it is tiled, offered or run. A single
  comparison is not enough: whether a reordered sum rounds apart depends on the numbers (a tiny Qwen2-MoE
  block came out bit for bit at 24 tokens, not at 8 or 40), and warm-up probes several lengths. Where the
  plain block's own gradients do not repeat (a kernel that sums with atomics) the comparison goes by the
  outputs, as every ``runs_as_plain`` does, and such a block is tiled (OLMo 2 on a GPU: docs/faq.md);
  without memfit its gradients differ from run to run by as much.
* Under FSDP2 (``fully_shard``) an MLP is tiled as any other: while a block runs, its forward or its
  backward, FSDP2 has set the module's parameters to the unsharded ones it gathered (the same tensors
  in both, their storage freed between), so the Function's re-runs in backward use, and return the
  gradients of, exactly the tensors FSDP2 reduce-scatters from (tests/test_distributed.py: FSDP2's
  weights without memfit, bit for bit in one chunk). Under FSDP1 (flat parameters, whose module
  tensors are views) and DeepSpeed ZeRO-3 (which gathers inside each module's hooks) nothing is tiled:
  untested, so not offered.
* Eager blocks only: a compiled block's graph never calls the patched forward.

The chunk count comes from the shape (:class:`Chunking`): enough chunks that one chunk's ``tokens x
intermediate`` tensor is at most ``chunk_bytes`` (in the input's element size), and no chunk under
``min_tokens`` (:data:`MIN_CHUNK_TOKENS`) tokens, so a chunk's matmuls stay large enough to run at the
matmul's speed. With these a chunk's transient in backward (its intermediates and their gradients, about
eight such tensors) stays near a GiB however long the sequence; the planner does not choose the count
(the saving at the backward's start, what plans are chosen on, is the same for any count: only the MLP's
input is kept). A re-run's chunks (``recompute_tiled``'s, ``host_checkpoint_tiled``'s) are half a kept
block's (:data:`RERUN_CHUNK_BYTES` against :data:`CHUNK_BYTES`): those treatments are chosen where a
block's backward sets the step's peak, and there a chunk's transient sits on top of everything the
re-run brought back, so a smaller chunk lowers the floor itself; a kept tiled block, chosen for what it
saves at the backward's start, keeps the larger chunks: fewer of them, fewer launches.

What a tiled block keeps is the plain block's saved tensors less the MLP's intermediates (the MLP's
input is saved by the Function; its projections would have saved it too), which the probe counts;
its price is its forward and backward beyond the plain block's (about one more forward of the MLP),
measured. ``recompute_tiled`` and ``host_checkpoint_tiled`` re-run a block whole with its MLP tiled
inside: their recompute brings back what a tiled block keeps, not what a kept one does
(``Treatment.rerun_keeps``: NOTE [Treated peaks], model.py).

# NOTE [Lean inputs in a tiled block]
Outside the MLP, what a block saves at its input's width is mostly float32 copies of bfloat16 tensors:
an RMSNorm written in Python saves its input cast to float32 (twice the input's bytes), and a peft LoRA
layer whose adapters are float32 (peft's default over bfloat16 weights) casts its input to float32 and
its ``lora_A`` saves that copy: one each for q, k and v of the same input, and o's. For a LoRA Llama
block that is about eight hidden-wide bfloat16 tensors' worth beside two for the attention. The tiled
treatments run these parts as the MLP runs in one chunk (:func:`tiled_mlp` with ``chunks=1``): each
saves only its input (the bfloat16 one, which q, k and v share: one tensor saved once) and computes
again in backward what it would have saved, from that input, under the forward's autocast state and,
where the part may draw random numbers (an adapter's dropout of p > 0; never a norm), its RNG state.
So their gradients are ``keep``'s bit for bit (the same ops on the same inputs; the autograd
Function's node takes the place of the part's first node, so gradients reach a tensor with several
consumers in the same order). That holds where the part's first op is the input's one
consumer inside it: a norm runs lean for a bfloat16 or float16 input only (its first op, the cast to
float32; a float32 input is used by several of its ops, whose gradients would be summed in another order,
and it saves no copy to spare), an adapter only where its input is cast. A norm that trains no parameter
(a LoRA's norms) runs in chunks of tokens (:func:`norm_chunks`), forward and backward: in one piece its
backward holds about a dozen tensors of its input's size at once, half of them float32 (6.5 GiB above a
block's other bytes for a 64k x 4096 bfloat16 input: a long step's peak, twice a block), and a norm is
token-wise, each token's output and input gradient its own row's, so chunked they are the same bits. A
norm with a trainable weight (full fine-tuning) runs in the same chunks in a tiled block (an MLP tiled
beside it): its output and input gradient are the same bits, and its weight's gradient, a sum over tokens,
is the chunks' gradients summed in float32 and cast once, as the tiled MLP's parameters' (within float32
rounding of ``keep``'s: the sum reorders; in one chunk, where the input is short, bit for bit). Under
``lean`` alone, whose gradients are ``keep``'s bit for bit, it runs in one piece.

A LoRA layer also makes float32 tensors of its whole output: peft adds ``lora_B``'s float32 output, scaled,
to the base layer's output in float32 and casts the sum back (the scaled output and the sum, then in
backward the sum's float32 gradient, its cast and its scaled copy: 14 bytes an output element at the
forward's peak where the model's dtype is 2). The lean layer (:class:`_LeanLoraForward`, a vanilla
layer with one active adapter; any other call runs peft's own forward) computes what peft computes, in
peft's order: the base layer, ``lora_B(lora_A(dropout(x cast)))`` with ``lora_A``'s part re-run from the
uncast input as above (its dropout, any ``p``, draws the forward's mask again), then the scaled sum and
its cast in chunks of rows into the output (:class:`_LoraSum`: the same elementwise ops on the same
values, so the same bits) and, in backward, the scaled float32 gradient in chunks (the sum's gradient cast
back to the model's dtype is the incoming gradient itself). At its peak it holds ``lora_B``'s output and
the result: 8 bytes an output element, 6 in backward.

The parts (:func:`lean_parts`): the block's norms (:func:`elementwise_parts`) and its vanilla peft LoRA
linear layers (no DoRA or other variant), outside the MLPs tiled. What this costs is a norm's
elementwise ops and an adapter's rank-wide projection again in backward, and the sums' chunks: priced
with the tiled MLP, measured.

# NOTE [Hollow re-runs]
A re-run's forward (``recompute_tiled``'s and ``host_checkpoint_tiled``'s: a non-reentrant checkpoint's
recompute, in backward) runs for what it saves; its outputs are dropped. A tiled MLP saves only its
input and its own backward computes its chunks again, so in the re-run its forward's chunks (a whole
forward of the MLP, the step's third) are wasted wherever nothing the block computes after the MLP
saves a tensor (a Llama block: the residual add, which saves none). There the re-run's MLP runs
hollow: the Function saves its input as before (the checkpoint matches saved tensors by their order)
and returns zeros of the output's shape and dtype, computing nothing; the ops after it save nothing
(and the checkpoint's early stop ends the re-run at its last saved tensor). Where something after the
MLP saves (Gemma-2's norm after it, Phi-3's dropout around it) the MLP runs whole. Which MLPs may run
hollow is read once per block from its first tiled forward's autograd graph (:func:`_hollow_mlps`):
walking from the block's outputs back to its inputs, no node between an MLP's node and the outputs
saves a tensor (its ``_raw_saved_*`` attributes; a custom Function's node counts as saving). A body's
first call is its forward, every later one a re-run, so each checkpoint gets a body of its own
(:func:`tiled_body`). The saved tensors and the backward are the whole re-run's, so are the gradients,
bit for bit; the treatments' probes time the hollow re-run, so their prices follow.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from memfit.engine.shapes import first_tensor
from memfit.engine.parts.treatments.base import RunOptions, Treatment
from memfit.engine.parts.treatments.elementwise import elementwise_parts, runs_as_plain, swapped_forwards

if TYPE_CHECKING:
    from memfit.engine.parts.treatments.base import Block, ProbeKit

__all__ = ["TILED_MLP", "TiledMlp", "TiledReruns", "Chunking", "tiled_mlp", "tileable_mlps", "tiled", "mlp_chunks", "CHUNK_BYTES",
           "MIN_CHUNK_TOKENS", "RERUN_CHUNK_BYTES", "lean_parts", "norm_chunks", "widest_intermediate"]

logger = logging.getLogger("memfit")

TILED_MLP = "tiled_mlp"

#: the most bytes of one chunk's ``tokens x intermediate`` tensor in a kept block (NOTE [Tiled MLP])
CHUNK_BYTES = 128 * 2**20
#: the same in a re-run (``recompute_tiled``, ``host_checkpoint_tiled``: NOTE [Tiled MLP])
RERUN_CHUNK_BYTES = 64 * 2**20
#: the fewest tokens of a chunk: its matmuls stay large (NOTE [Tiled MLP])
MIN_CHUNK_TOKENS = 1024


@dataclass
class Chunking:
    """How many chunks an MLP's tokens run in (NOTE [Tiled MLP]).

    Attributes:
        chunk_bytes: the most bytes of one chunk's ``tokens x intermediate`` tensor.
        min_tokens: the fewest tokens of a chunk.
        at_least: the fewest chunks (a test's, or the probe's: two, to see that the MLP is token-wise).
    """

    chunk_bytes: int = CHUNK_BYTES
    min_tokens: int = MIN_CHUNK_TOKENS
    at_least: int = 1

    @classmethod
    def rerun(cls) -> "Chunking":
        """The chunks of a re-run's MLP (NOTE [Tiled MLP]): at most :data:`RERUN_CHUNK_BYTES`."""
        return cls(chunk_bytes=RERUN_CHUNK_BYTES)

    def count(self, tokens: int, intermediate: int, element_bytes: int) -> int:
        """Chunks for ``tokens`` through an MLP of ``intermediate`` features.

        Example:
            >>> Chunking().count(65536, 14336, 2)  # an 8B Llama's MLP at 64k tokens: chunks of 128 MiB at most
            15
            >>> Chunking().count(4096, 14336, 2)  # short: one chunk of 112 MiB
            1
            >>> Chunking().count(3000, 100_000, 2)  # a wide MLP: no chunk under 1,024 tokens
            2
        """
        per_chunk = max(1, self.chunk_bytes // max(1, intermediate * element_bytes))  # tokens in chunk_bytes
        by_bytes = math.ceil(tokens / per_chunk)
        by_tokens = max(1, tokens // max(1, self.min_tokens))
        return max(1, min(tokens, max(self.at_least, min(by_bytes, by_tokens))))


def _sharded(module: nn.Module) -> bool:
    """Whether ``module``'s parameters are sharded as nothing tiled may be (FSDP1, DeepSpeed ZeRO-3: NOTE [Tiled
    MLP]; FSDP2's are not)."""
    if any("FullyShardedDataParallel" in type(m).__name__ for m in module.modules()):
        return True
    return any(type(p).__name__ == "FlatParameter" or hasattr(p, "ds_id") for p in module.parameters())


def _draws(mlp: nn.Module) -> bool:
    """Whether a dropout module of ``p > 0`` is inside ``mlp`` (a LoRA dropout: NOTE [Tiled MLP]), or is it (a vanilla
    peft adapter's, ``nn.Dropout`` or ``nn.Identity``)."""
    return any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in mlp.modules())


def tileable_mlps(module: nn.Module) -> list[nn.Module]:
    """The gated MLPs of ``module`` that the tiled treatments run in chunks (NOTE [Tiled MLP]): those
    :func:`elementwise_parts` finds, less those with a dropout inside or sharded parameters."""
    if _sharded(module):
        return []
    return [m for m in elementwise_parts(module)[1] if not _draws(m)]


def _intermediate(mlp: nn.Module) -> int:
    """The MLP's intermediate features: what ``down_proj`` takes."""
    down = mlp.down_proj
    features = getattr(down, "in_features", None)
    return int(features) if features else int(down.weight.shape[1])


def widest_intermediate(modules: Sequence[nn.Module]) -> int:
    """The widest gated MLP's intermediate features among ``modules`` (0 without one): a plain forward of it holds its
    gate's and up projection's outputs together, twice that a token (NOTE [Warm-up on the floor], methods/dynamic.py)."""
    return max((_intermediate(m) for module in modules for m in elementwise_parts(module)[1]), default=0)


def _autocast_states(device_type: str) -> list[tuple[str, bool, torch.dtype]]:
    """The autocast state of ``device_type`` and the CPU's, for the device types autocast knows (not
    ``meta``, which ``memfit estimate`` counts tiled MLPs on)."""
    types = [device_type] if device_type == "cpu" else [device_type, "cpu"]
    return [(t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in types if torch.amp.is_autocast_available(t)]


class _TiledMlpFunction(torch.autograd.Function):
    """``forward(ctx, run, x, chunks, draws, *params)``: ``run`` (the MLP's own forward) over ``chunks`` runs
    of ``x``'s tokens, saving only ``x`` (NOTE [Tiled MLP]); ``params`` are the MLP's trainable
    parameters, which ``run`` uses; ``draws``: whether ``run`` may draw random numbers (the RNG state is then
    kept for the backward's runs; a norm's or a dropout-free adapter's run draws none)."""

    @staticmethod
    def forward(ctx: Any, run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, chunks: int, draws: bool,
                *params: torch.Tensor) -> torch.Tensor:
        ctx.run, ctx.chunks, ctx.params = run, chunks, params
        if isinstance(run, _Hollow):  # a re-run's MLP: its input saved, nothing computed (NOTE [Hollow re-runs])
            ctx.autocast, ctx.devices, ctx.rng = (), [], None
            ctx.save_for_backward(x)
            return x.new_zeros((*x.shape[:-1], run.width), dtype=run.dtype)
        ctx.autocast = _autocast_states(x.device.type)
        ctx.devices = [x.device] if x.device.type == "cuda" else []
        ctx.rng = (torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in ctx.devices]) if draws else None
        ctx.save_for_backward(x)
        with torch.no_grad():
            if chunks == 1:
                return run(x)
            rows = x.reshape(-1, x.shape[-1])
            out = None
            for start, stop in _bounds(rows.shape[0], chunks):
                y = run(rows[start:stop])
                if out is None:
                    out = y.new_empty((*x.shape[:-1], y.shape[-1]))
                out.view(-1, y.shape[-1])[start:stop].copy_(y)
                del y
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        params = ctx.params
        wants_x = ctx.needs_input_grad[1]
        whole = ctx.chunks == 1  # the input as it came, as the untiled MLP runs it
        rows = x.detach() if whole else x.detach().reshape(-1, x.shape[-1])
        grads_out = grad_out if whole else grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = None
        sums: list[torch.Tensor | None] = [None] * len(params)
        with contextlib.ExitStack() as stack:
            if ctx.rng is not None:
                stack.enter_context(torch.random.fork_rng(devices=ctx.devices))
                torch.set_rng_state(ctx.rng[0])
                for device, state in zip(ctx.devices, ctx.rng[1]):
                    torch.cuda.set_rng_state(state, device)
            for device_type, enabled, dtype in ctx.autocast:
                stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
            stack.enter_context(torch.enable_grad())
            for start, stop in [(0, None)] if whole else _bounds(rows.shape[0], ctx.chunks):
                chunk = rows[start:stop].detach().requires_grad_(wants_x)
                y = ctx.run(chunk)
                wrt = ([chunk] if wants_x else []) + list(params)
                grads = torch.autograd.grad(y, wrt, grads_out[start:stop], allow_unused=True)
                del y
                if wants_x:
                    if whole:
                        grad_x = grads[0]
                    else:
                        if grad_x is None:
                            grad_x = torch.empty_like(rows)
                        grad_x[start:stop].copy_(grads[0])
                    grads = grads[1:]
                if whole:  # one chunk's gradients are the whole's: no float32 sum (NOTE [Tiled MLP])
                    return (None, grad_x, None, None, *grads)
                for j, g in enumerate(grads):
                    if g is not None:  # float32 sums, cast once (NOTE [Tiled MLP])
                        sums[j] = g.float() if sums[j] is None else sums[j].add_(g)
                del grads
        param_grads: list[torch.Tensor | None] = []
        for j, p in enumerate(params):  # each sum freed as it is cast: one parameter's two copies at a time
            param_grads.append(None if sums[j] is None else sums[j].to(p.dtype))
            sums[j] = None
        return (None, None if grad_x is None else grad_x.view(x.shape), None, None, *param_grads)


def _bounds(rows: int, chunks: int) -> list[tuple[int, int]]:
    """``chunks`` runs of ``rows`` rows, as even as can be (the first ones one row longer)."""
    chunks = max(1, min(chunks, rows))
    size, extra = divmod(rows, chunks)
    out, at = [], 0
    for i in range(chunks):
        stop = at + size + (i < extra)
        out.append((at, stop))
        at = stop
    return out


@dataclass(frozen=True)
class _Hollow:
    """The ``run`` of a hollow re-run's MLP (NOTE [Hollow re-runs]): the output's width and dtype, and nothing to run."""

    width: int
    dtype: torch.dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("memfit: a hollow re-run's MLP was differentiated (its re-run's outputs should be dropped)")


#: the most autograd nodes a block's walk for hollow MLPs visits before it gives up (none then runs hollow)
HOLLOW_WALK_NODES = 20_000


def _saves(node: Any) -> bool:
    """Whether an autograd node holds a tensor for its backward (a custom Function's node is taken to)."""
    if isinstance(node, torch.autograd.function.BackwardCFunction):
        return True
    for name in dir(node):
        if name.startswith("_raw_saved_"):
            held = getattr(node, name, None)
            if held is not None and not (isinstance(held, (list, tuple)) and not held):
                return True
    return False


def _hollow_mlps(out: Any, inputs: Any, nodes: dict[int, Any]) -> set[int]:
    """Of a block's tiled MLPs (``nodes``: each one's id and its Function's node in the block's first run), those after
    which nothing the block computes saves a tensor: the walk goes from the block's outputs back to its inputs' nodes
    (NOTE [Hollow re-runs])."""
    targets = {node: key for key, node in nodes.items()}
    stops = {t.grad_fn for t in tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.grad_fn is not None}
    reach: dict[Any, frozenset[int]] = {}  # per node, the MLPs below it (on a path to the inputs)
    stack = [(t.grad_fn, False) for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while stack:
        node, children_done = stack.pop()
        if node in reach:
            continue
        if node in stops:
            reach[node] = frozenset()
        elif not children_done:
            if len(reach) + len(stack) > HOLLOW_WALK_NODES:
                return set()
            stack.append((node, True))
            stack.extend((child, False) for child, _ in node.next_functions if child is not None and child not in reach)
        else:
            below = {k for child, _ in node.next_functions if child is not None for k in reach.get(child, ())}
            reach[node] = frozenset(below | ({targets[node]} if node in targets else set()))
    dirty: set[int] = set()
    for node, below in reach.items():
        if below and _saves(node):
            dirty |= below - {targets.get(node)}
    return set(targets.values()) - dirty


def tiled_mlp(run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, chunks: int, params: Sequence[torch.Tensor]) -> torch.Tensor:
    """``run(x)`` (a token-wise MLP whose trainable parameters are ``params``) in ``chunks`` runs of
    tokens, saving only ``x`` for backward (NOTE [Tiled MLP]).

    Example:
        >>> mlp = nn.Sequential(nn.Linear(4, 16), nn.SiLU(), nn.Linear(16, 4))
        >>> x = torch.randn(2, 5, 4, requires_grad=True)
        >>> y = tiled_mlp(mlp, x, 3, [p for p in mlp.parameters()])
        >>> torch.testing.assert_close(y, mlp(x))
    """
    return _TiledMlpFunction.apply(run, x, chunks, True, *params)


def mlp_chunks(mlp: nn.Module, x: torch.Tensor, chunking: Chunking) -> int:
    """The chunks ``mlp`` (a gated MLP) runs ``x``'s tokens in when tiled (NOTE [Tiled MLP])."""
    return chunking.count(x.numel() // x.shape[-1], _intermediate(mlp), x.element_size())


class _TiledForward:
    """A gated MLP's forward as the model's, its tokens in chunks (NOTE [Tiled MLP]); in a re-run, hollow where
    ``hollow`` gives its output's width and dtype, and in a body's first run noting its node, width and dtype in
    ``seen`` (NOTE [Hollow re-runs])."""

    def __init__(self, mlp: nn.Module, chunking: Chunking, hollow: tuple[int, torch.dtype] | None = None,
                 seen: dict[int, tuple[Any, int, torch.dtype]] | None = None):
        self.mlp, self.chunking, self.hollow, self.seen = mlp, chunking, hollow, seen
        self.plain = type(mlp).forward.__get__(mlp)

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        params = [p for p in self.mlp.parameters() if p.requires_grad]
        if args or kwargs or not isinstance(x, torch.Tensor) or x.dim() < 2 or not torch.is_grad_enabled() or not (params or x.requires_grad):
            return self.plain(x, *args, **kwargs)
        chunks = mlp_chunks(self.mlp, x, self.chunking)
        if self.hollow is not None:
            return _TiledMlpFunction.apply(_Hollow(*self.hollow), x, chunks, False, *params)
        y = tiled_mlp(self.plain, x, chunks, params)
        if self.seen is not None and isinstance(y, torch.Tensor):
            self.seen[id(self.mlp)] = (y.grad_fn, y.shape[-1], y.dtype)
        return y


class _EvaluationChunks:
    """A gated MLP's forward as the model's, its tokens in ``chunks`` runs without autograd, each chunk's output written
    into one output tensor (NOTE [Blocks in evaluation])."""

    def __init__(self, mlp: nn.Module, chunks: int):
        self.plain, self.chunks = type(mlp).forward.__get__(mlp), chunks

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs or not isinstance(x, torch.Tensor) or x.dim() < 2:
            return self.plain(x, *args, **kwargs)
        rows, out = x.reshape(-1, x.shape[-1]), None
        for start, stop in _bounds(rows.shape[0], self.chunks):
            y = self.plain(rows[start:stop])
            if out is None:
                out = y.new_empty((rows.shape[0], y.shape[-1]))
            out[start:stop] = y
        return out.reshape(*x.shape[:-1], out.shape[-1])


#: a plain forward of a gated MLP, in ``tokens x intermediate`` tensors of its dtype at once: the gate's and up
#: projection's outputs, the activation and the product, and a LoRA adapter's float32 output (two more) (NOTE [Blocks
#: in evaluation])
EVALUATION_INTERMEDIATES = 6


def tiled_evaluation(free: Callable[[torch.device], int | None] | None) -> Callable[[Any, tuple, dict], Any] | None:
    """A block's forward without autograd, its gated MLPs tiled where whole they would not fit ``free`` (what the room
    has free now on the device: NOTE [Blocks in evaluation]); None where there is no such reading.

    # NOTE [Blocks in evaluation]
    A forward without autograd (a Trainer's evaluation, generation's prefill) runs each block as the model does: no
    treatment applies, so at 64k tokens an 8B LoRA trained in 12 GiB ran out of memory in its first block's MLP at
    evaluation (its ``tokens x intermediate`` tensors, 1.75 GiB each in bf16, 3.5 in a LoRA adapter's float32). So,
    on CUDA under a budget, a block whose gated MLPs (those the tiled treatments find; a dropout inside counts only in
    training mode) would make ``EVALUATION_INTERMEDIATES`` such tensors over half of what the room has free runs them
    in chunks of tokens (at least two, no more bytes than :class:`Chunking`'s nor than half the room), one chunk's
    intermediates alive at a time. The
    outputs equal the plain block's within the dtype's rounding (a chunk's matmul may block its sums otherwise); a
    forward that fits, and every training forward, is untouched. A compiled block runs as compiled.
    """
    if free is None:
        return None
    found: list[tuple[nn.Module, bool]] | None = None  # the block's gated MLPs and whether each draws, found once

    def run(block: Any, args: tuple, kwargs: dict) -> Any:
        nonlocal found
        x = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")
        if found is None:
            found = [] if block.compiled or _sharded(block.module) else [(m, _draws(m)) for m in elementwise_parts(block.module)[1]]
        training = block.module.training
        mlps = [m for m, draws in found if not (training and draws)] if isinstance(x, torch.Tensor) and x.dim() >= 2 else []
        room = free(x.device) if mlps else None
        if room is None:
            return block.body(*args, **kwargs)
        tokens, widest = x.numel() // x.shape[-1], max(_intermediate(m) for m in mlps)
        whole = EVALUATION_INTERMEDIATES * tokens * widest * x.element_size()
        if whole <= room // 2:
            return block.body(*args, **kwargs)
        chunks = min(tokens, max(2, Chunking().count(tokens, widest, x.element_size()), -(-2 * whole // max(1, room))))
        with swapped_forwards([(m, _EvaluationChunks(m, chunks)) for m in mlps]):
            return block.body(*args, **kwargs)
    return run


def _is_lora_layer(m: nn.Module) -> bool:
    """A vanilla peft LoRA linear layer (NOTE [Lean inputs in a tiled block]): ``lora_A`` linear adapters, a
    linear base layer, the input cast peft can switch off, no variant (DoRA and the like)."""
    adapters = getattr(m, "lora_A", None)
    return (isinstance(adapters, nn.ModuleDict) and len(adapters) > 0 and hasattr(m, "_cast_input_dtype")
            and isinstance(getattr(m, "lora_dropout", None), nn.ModuleDict) and isinstance(getattr(m, "base_layer", None), nn.Linear)
            and not getattr(m, "lora_variant", None) and all(isinstance(a, nn.Linear) for a in adapters.values()))


def lean_parts(module: nn.Module, mlps: Sequence[nn.Module] = ()) -> list[nn.Module]:
    """The norms and vanilla peft LoRA layers of ``module`` outside ``mlps`` (tiled already), which the tiled
    treatments run saving only their input (NOTE [Lean inputs in a tiled block])."""
    if _sharded(module):  # as the tiled MLP (NOTE [Tiled MLP])
        return []
    inside = {id(m) for mlp in mlps for m in mlp.modules()}
    norms, _ = elementwise_parts(module)
    return [m for m in module.modules() if id(m) not in inside and (_is_lora_layer(m) or any(m is n for n in norms))]


def _rerun(run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, params: Sequence[torch.Tensor],
           chunks: int = 1, draws: bool = True) -> torch.Tensor:
    """``run(x)`` saving only ``x``, ``run`` again in backward (the tiled MLP's Function, in one chunk unless told;
    under the forward's RNG state where it ``draws``)."""
    return _TiledMlpFunction.apply(run, x, chunks, draws, *params)


#: the input dtypes a norm runs lean for: a norm casts them first (one consumer of the input, whose gradient then
#: reaches it in one piece as without the re-run); a float32 input a norm uses in several ops would get their
#: gradients summed in another order (NOTE [Lean inputs in a tiled block])
_NARROW = (torch.bfloat16, torch.float16)


#: a norm's chunk is counted as an MLP chunk of this many times its width: its backward holds about a dozen tensors
#: of its input's size, half of them float32, so its chunk's transient stays under half an MLP chunk's (NOTE [Lean
#: inputs in a tiled block])
NORM_SPREAD = 4


def norm_chunks(x: torch.Tensor, chunking: Chunking) -> int:
    """The chunks a lean norm runs ``x``'s tokens in (NOTE [Lean inputs in a tiled block]).

    Example:
        >>> norm_chunks(torch.empty(1, 65536, 4096, dtype=torch.bfloat16, device="meta"), Chunking())  # 32 MiB a chunk
        16
    """
    return chunking.count(x.numel() // x.shape[-1], NORM_SPREAD * x.shape[-1], x.element_size())


class _LeanForward:
    """A norm's forward saving only its input, in chunks of tokens (NOTE [Lean inputs in a tiled block])."""

    def __init__(self, module: nn.Module, chunking: Chunking, sums: bool):
        self.module, self.chunking, self.sums = module, chunking, sums
        self.plain = type(module).forward.__get__(module)

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        params = [p for p in self.module.parameters() if p.requires_grad]
        if (args or kwargs or not isinstance(x, torch.Tensor) or x.dtype not in _NARROW or not torch.is_grad_enabled()
                or not (params or x.requires_grad)):
            return self.plain(x, *args, **kwargs)
        # a trained weight's gradient is a sum over tokens: chunked (summed in float32) only where ``sums`` allows
        chunks = 1 if x.dim() < 2 or (params and not self.sums) else norm_chunks(x, self.chunking)
        return _rerun(self.plain, x, params, chunks, draws=False)


class _LeanAdapter:
    """A LoRA layer's ``lora_A`` given the layer's input uncast: the cast, the dropout and the projection in
    one re-run saving that input (NOTE [Lean inputs in a tiled block])."""

    def __init__(self, adapter: nn.Linear, dropout: nn.Module):
        self.adapter, self.dropout = adapter, dropout

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        return self.adapter(self.dropout(x.to(self.adapter.weight.dtype)))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        params = [p for p in self.adapter.parameters() if p.requires_grad]
        if x.dtype == self.adapter.weight.dtype or not torch.is_grad_enabled() or not (params or x.requires_grad):
            return self.plain(x)
        return _rerun(self.plain, x, params, draws=_draws(self.dropout))


#: the most elements of one chunk of a LoRA layer's sum, and the fewest chunks (a chunk's float32 temporaries are
#: two of its size beside the whole output's: NOTE [Lean inputs in a tiled block])
SUM_CHUNK_ELEMENTS = 2**24
MIN_SUM_CHUNKS = 8


class _LoraSum(torch.autograd.Function):
    """``(base + lora * scaling).to(base.dtype)``, ``base`` in the model's dtype and ``lora`` float32, as peft's
    LoRA layer sums them, chunk by chunk of rows: no float32 tensor of the whole output beside ``lora`` itself,
    forward or backward (NOTE [Lean inputs in a tiled block])."""

    @staticmethod
    def forward(ctx: Any, base: torch.Tensor, lora: torch.Tensor, scaling: float) -> torch.Tensor:
        ctx.scaling, ctx.lora_dtype = scaling, lora.dtype
        out = torch.empty_like(base)
        rows_in, rows_out = base.reshape(-1, base.shape[-1]), out.view(-1, base.shape[-1])
        lora_rows = lora.reshape(-1, lora.shape[-1])
        for start, stop in _sum_chunks(rows_in.shape):
            rows_out[start:stop].copy_(rows_in[start:stop] + lora_rows[start:stop] * scaling)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # the sum's float32 gradient cast back to the base's dtype is the incoming gradient, exactly
        grad_lora = None
        if ctx.needs_input_grad[1]:
            grad_lora = torch.empty(grad.shape, dtype=ctx.lora_dtype, device=grad.device)
            rows, out = grad.reshape(-1, grad.shape[-1]), grad_lora.view(-1, grad.shape[-1])
            for start, stop in _sum_chunks(rows.shape):
                out[start:stop].copy_(rows[start:stop].to(ctx.lora_dtype) * ctx.scaling)
        return grad if ctx.needs_input_grad[0] else None, grad_lora, None


def _sum_chunks(shape: torch.Size) -> list[tuple[int, int]]:
    rows, width = shape[0], max(1, shape[-1])
    return _bounds(rows, max(MIN_SUM_CHUNKS, -(-rows * width // SUM_CHUNK_ELEMENTS))) if rows else []


class _LeanLoraForward:
    """A vanilla peft LoRA linear layer's forward with one active adapter, computed as peft computes it (the base
    layer, then ``lora_B(lora_A(dropout(x cast)))`` scaled and added in float32, cast back), with ``lora_A`` re-run
    from the uncast input and the sum in chunks (NOTE [Lean inputs in a tiled block]); any other case runs peft's."""

    def __init__(self, layer: nn.Module):
        self.layer = layer
        self.plain = type(layer).forward.__get__(layer)

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        layer = self.layer
        active = [a for a in layer.active_adapters if a in layer.lora_A]
        if (args or kwargs or not isinstance(x, torch.Tensor) or layer.disable_adapters or layer.merged or len(active) != 1
                or not getattr(layer, "cast_input_dtype_enabled", True) or not torch.is_grad_enabled()):
            return self.plain(x, *args, **kwargs)
        key = active[0]
        adapter, up = layer.lora_A[key], layer.lora_B[key]
        dtype = adapter.weight.dtype
        # decided before anything runs (a dropout's draw must happen once): nothing cast, nothing to spare; under
        # autocast the adapters' output is not float32, and peft's sum is then its own
        if (x.dtype == dtype or up.weight.dtype != dtype or layer.base_layer.weight.dtype == dtype
                or (torch.amp.is_autocast_available(x.device.type) and torch.is_autocast_enabled(x.device.type))):
            return self.plain(x, *args, **kwargs)
        return _LoraSum.apply(layer.base_layer(x), up(_LeanAdapter(adapter, layer.lora_dropout[key])(x)), layer.scaling[key])


@contextlib.contextmanager
def tiled(mlps: Sequence[nn.Module], chunking: Chunking, lean: Sequence[nn.Module] = (),
          hollow: dict[int, tuple[int, torch.dtype]] | None = None, seen: dict[int, Any] | None = None) -> Iterator[None]:
    """Run ``mlps`` (:func:`tileable_mlps`) tiled and ``lean`` (:func:`lean_parts`) saving only their input while
    the context is open (their instances' ``forward``, put back after); the MLPs ``hollow`` names hollow, and each
    other's node, width and dtype noted in ``seen`` (NOTE [Hollow re-runs])."""
    pairs: list[tuple[nn.Module, Callable[..., Any]]] = [
        (mlp, _TiledForward(mlp, chunking, (hollow or {}).get(id(mlp)), seen)) for mlp in mlps]
    # a trained norm's weight summed over chunks where an MLP is tiled (NOTE [Lean inputs in a tiled block])
    pairs += [(m, _LeanLoraForward(m) if _is_lora_layer(m) else _LeanForward(m, chunking, sums=bool(mlps))) for m in lean]
    with swapped_forwards(pairs):
        yield


def tiled_body(body: Callable[..., Any], mlps: Sequence[nn.Module], chunking: Chunking, lean: Sequence[nn.Module],
               verdict: dict[str, set[int]]) -> Callable[..., Any]:
    """One checkpoint's body: ``body`` (a block's) with ``mlps`` tiled and ``lean`` saving their inputs. Its first call is
    the forward, which notes which MLPs may run hollow where ``verdict`` (the block's, kept across steps) has none yet;
    its later ones are re-runs, whose MLPs the verdict names run hollow (NOTE [Hollow re-runs])."""
    seen: dict[int, tuple[Any, int, torch.dtype]] = {}
    calls = [0]

    def run(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            with tiled(mlps, chunking, lean, seen=seen):
                out = body(*args, **kwargs)
            if "hollow" not in verdict and seen:
                verdict["hollow"] = _hollow_mlps(out, (args, kwargs), {k: node for k, (node, _, _) in seen.items() if node is not None})
            return out
        hollow = {k: (width, dtype) for k, (_, width, dtype) in seen.items() if k in verdict.get("hollow", ())}
        with tiled(mlps, chunking, lean, hollow=hollow):
            return body(*args, **kwargs)

    return run


def offered(modules: Sequence[nn.Module], compile_options: dict[str, Any] | None) -> bool:
    """Whether the tiled treatments are offered by default: eager blocks with a gated MLP to tile."""
    return compile_options is None and any(tileable_mlps(m) for m in modules)


class TiledMlp(Treatment):
    """The block runs once, its gated MLP in chunks of tokens keeping only its input (NOTE [Tiled MLP]).

    Args:
        chunking: how many chunks an MLP's tokens run in.
    """

    name = TILED_MLP
    help = "the gated MLP in chunks of tokens, keeping only its input (its intermediates made again in backward, a chunk at a time)"
    # what it computes again is the MLP inside the block's backward, not the body: the partial
    # transient learns it (NOTE [Treated peaks], model.py), as for ``elementwise``
    order = 20
    eager_only = True

    @classmethod
    def for_run(cls, options: RunOptions) -> Treatment:
        return cls()

    @classmethod
    def by_default(cls, modules: Sequence[nn.Module], compile_options: dict[str, Any] | None) -> bool:
        """Offered to eager blocks with a gated MLP to tile (NOTE [Tiled MLP])."""
        return offered(modules, compile_options)

    def __init__(self, chunking: Chunking | None = None):
        self.chunking = chunking or Chunking()
        #: per block, its MLPs to tile and its parts to run lean, found once
        self._parts: dict[int, tuple[list[nn.Module], list[nn.Module]]] = {}
        #: per block, which MLPs its re-runs may run hollow, read from its first tiled forward (NOTE [Hollow re-runs])
        self.verdicts: dict[int, dict[str, set[int]]] = {}

    def tiled_parts(self, block: "Block") -> tuple[list[nn.Module], list[nn.Module]]:
        """The block's MLPs to tile and the parts it runs lean (NOTE [Lean inputs in a tiled block])."""
        found = self._parts.get(block.index)
        if found is None:
            mlps = tileable_mlps(block.module)
            found = self._parts[block.index] = (mlps, lean_parts(block.module, mlps) if mlps else [])
        return ([], []) if block.tiles_exactly is False else found  # NOTE [Tiled MLP]: run as it is

    def run(self, block: "Block", args: tuple, kwargs: dict[str, Any]) -> Any:
        mlps, lean = self.tiled_parts(block)
        with tiled(mlps, self.chunking, lean):
            return block.run_body(*args, **kwargs)

    @classmethod
    def probe(cls, block: "Block", kit: "ProbeKit") -> tuple[int, float | None] | None:
        """What the block keeps tiled and its price (forward and backward beyond the plain block's, the
        fastest of the timed runs, interleaved); None where it tiles nothing or its outputs tiled are
        not the plain block's (NOTE [Tiled MLP])."""
        measured = probe_tiled(block, kit)
        if measured is None:
            return None
        (mlps, lean), nbytes = measured
        chunking = Chunking()
        lean_ms, plain_ms = [], []
        for run in range(kit.timed_runs):  # NOTE [Cold runs of a block] (probe.py)
            lean_ms.append(kit.forward_backward_ms(block.body, kit.shield(), tiled(mlps, chunking, lean)))
            plain_ms.append(kit.plain_run_ms(run))
        return nbytes, max(0.0, min(lean_ms) - min(plain_ms))


def probe_tiled(block: "Block", kit: "ProbeKit") -> tuple[tuple[list[nn.Module], list[nn.Module]], int] | None:
    """The block's MLPs to tile and parts to run lean, and the bytes it keeps so (the counted run, in chunks that
    split every sequence); None for a compiled block, one with nothing to tile, or one whose outputs tiled are not
    its plain outputs within the dtype's rounding (NOTE [Tiled MLP]). Found once a block's probe, for every tiled
    treatment (``kit.found``)."""
    if "tiled" not in kit.found:
        kit.found["tiled"] = _probe_tiled(block, kit)
    return kit.found["tiled"]


def _probe_tiled(block: "Block", kit: "ProbeKit") -> tuple[tuple[list[nn.Module], list[nn.Module]], int] | None:
    mlps = tileable_mlps(block.module)
    if block.compiled or not mlps:
        return None
    lean = lean_parts(block.module, mlps)
    devices = [kit.device] if kit.device.type == "cuda" else []

    ordered: list[bool] = []  # read from the plain run's graph where the block's verdict is not known yet

    def forward(hooks: Any, context: Any, read_order: bool = False) -> list[torch.Tensor]:
        torch.random.set_rng_state(state[0])
        for d, s in zip(devices, state[1]):
            torch.cuda.set_rng_state(s, d)
        probe_args, probe_kwargs = kit.fresh()
        seen: dict[int, tuple[Any, Any]] = {}
        noted = noting_mlps(mlps, seen) if read_order else []
        try:
            with hooks, context:
                out = block.body(*probe_args, **probe_kwargs)
        finally:
            for hook in noted:
                hook.remove()
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if read_order:  # before the graph goes (NOTE [Tiled MLP])
            edges = graph_edges(outs)
            ordered.append(len(seen) == len(mlps) and all(keeps_sum_order(x, y, edges) for x, y in seen.values()))
        return [t.detach() for t in outs]

    # chunks that split every sequence of the batch: N + 1 chunks of N sequences never end where one does
    x = first_tensor(*kit.detached)
    chunking = Chunking(at_least=(x.shape[0] if x is not None and x.dim() >= 3 else 1) + 1)
    with torch.random.fork_rng(devices=devices):
        state = torch.random.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices]
        plain = forward(kit.shield(), contextlib.nullcontext(), read_order=block.tiles_exactly is None)
        counter = kit.counter_of_run()
        try:
            tiled_out = forward(counter.hooks(), tiled(mlps, chunking, lean))
        except torch.OutOfMemoryError:
            raise
        except Exception as err:  # an MLP that does not run in chunks: never offered
            logger.debug("memfit: block %s's MLP does not run in chunks (%s); the tiled treatments are not offered for it",
                         block.index, str(err).splitlines()[0][:200] if str(err) else type(err).__name__)
            return None
    if not _close(plain, tiled_out):
        logger.debug("memfit: block %s's MLP is not token-wise (its outputs in chunks differ); "
                     "the tiled treatments are not offered for it", block.index)
        return None
    if block.tiles_exactly is None and not ordered[0]:
        # the order may change: the sums taken here decide, at this probe and every later one (NOTE [Tiled MLP])
        if not runs_as_plain(block, kit, lambda: tiled(mlps, ONE_CHUNK), kit.shield(), cotangent=_cotangent):
            block.tiles_exactly = False
            logger.debug("memfit: block %s tiled sums its MLP input's gradient in another order (it has another use); "
                         "the tiled treatments are not offered for it", block.index)
        return None if block.tiles_exactly is False else ((mlps, lean), counter.bytes)
    if block.tiles_exactly is None:
        block.tiles_exactly = True
    return ((mlps, lean), counter.bytes) if block.tiles_exactly else None


#: one chunk whatever the tokens (NOTE [Tiled MLP]: the run whose gradients are compared)
ONE_CHUNK = Chunking(chunk_bytes=2**62)


def _cotangent(t: torch.Tensor, i: int) -> torch.Tensor:
    """An output's gradient for the comparison: random numbers, which reach every path (NOTE [Tiled MLP])."""
    return torch.randn(t.shape, generator=torch.Generator(t.device).manual_seed(i), device=t.device, dtype=t.dtype)


def noting_mlps(mlps: Sequence[nn.Module], seen: dict[int, tuple[Any, Any]]) -> list[Any]:
    """Forward hooks noting each of ``mlps``' first call's input (its first tensor, by position or keyword) and output
    in ``seen`` (by ``id``): their handles. An MLP not called is not noted."""
    def note(module: nn.Module, args: tuple, kwargs: dict[str, Any], out: Any) -> None:
        x = first_tensor(args, kwargs)
        if x is not None:
            seen.setdefault(id(module), (x, out))

    return [m.register_forward_hook(note, with_kwargs=True) for m in mlps]


def graph_edges(outputs: Sequence[Any]) -> list[tuple[Any, int]]:
    """Every edge of the autograd graph behind ``outputs`` (tensors and anything else: only tensors with a node count)."""
    return _edges_from([t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None], stop=None)


def keeps_sum_order(x: Any, y: Any, edges: list[tuple[Any, int]]) -> bool:
    """Whether an MLP run on ``x`` that gave ``y``, tiled, keeps the order in which ``x``'s gradient is summed in the
    graph of ``edges`` (:func:`graph_edges`; NOTE [Tiled MLP]): ``x`` takes no gradient, or the MLP uses it once, or
    nothing outside the MLP does (the edges to ``x``'s node from the MLP's nodes, and from the others)."""
    if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.requires_grad):
        return True
    to_x = _edge_matcher(x)
    inside = sum(1 for e in _edges_from([y.grad_fn] if y.grad_fn is not None else [], stop=to_x) if to_x(e))
    return inside <= 1 or sum(1 for e in edges if to_x(e)) <= inside


def _edge_matcher(x: torch.Tensor) -> Callable[[tuple[Any, int]], bool]:
    """Whether an autograd edge leads to ``x`` (its node and output, or its accumulator where it is a leaf)."""
    if x.grad_fn is None:
        return lambda e: e[0] is not None and getattr(e[0], "variable", None) is x
    return lambda e: e[0] is x.grad_fn and e[1] == x.output_nr


def _edges_from(nodes: list[Any], stop: Callable[[tuple[Any, int]], bool] | None) -> list[tuple[Any, int]]:
    """Every edge of the graph behind ``nodes``, each node's once; an edge ``stop`` matches is listed, not followed."""
    edges, done, todo = [], set(), list(nodes)
    while todo:
        node = todo.pop()
        if node is None or id(node) in done:
            continue
        done.add(id(node))
        for edge in node.next_functions:
            edges.append(edge)
            if edge[0] is not None and not (stop is not None and stop(edge)):
                todo.append(edge[0])
    return edges


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Equal within the dtype's rounding (a chunk's matmul may sum in another order)."""
    if len(a) != len(b) or any(x.shape != y.shape or x.dtype != y.dtype for x, y in zip(a, b)):
        return False
    try:
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y)
    except AssertionError:
        return False
    return True


class TiledReruns:
    """What the re-runs with their MLP tiled share (``recompute_tiled``, ``host_checkpoint_tiled``): a
    ``tiled_mlp`` of their own (its ``chunking`` theirs) and the block's body run with it."""

    _tiled: TiledMlp

    @property
    def chunking(self) -> Chunking:
        """How many chunks an MLP's tokens run in (NOTE [Tiled MLP])."""
        return self._tiled.chunking

    @chunking.setter
    def chunking(self, value: Chunking) -> None:
        self._tiled.chunking = value

    def tiled_run_body(self, block: "Block") -> Callable[..., Any]:
        """One checkpoint's body: the block's with its gated MLPs tiled and its norms and adapters lean while it
        runs, its re-runs' MLPs hollow where the block's verdict allows (NOTE [Hollow re-runs])."""
        mlps, lean = self._tiled.tiled_parts(block)
        return tiled_body(block.run_body, mlps, self.chunking, lean, self._tiled.verdicts.setdefault(block.index, {}))

