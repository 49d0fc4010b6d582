"""Find the checkpointable blocks of a model and wrap each so that a treatment can be applied per step.

A *block* is one unit memfit may checkpoint: a transformer layer (``BertLayer``,
``SwinLayer``, ``T5Block``, ...). Discovery order:

1. blocks the user names (``blocks=`` modules, or a regular expression on module names);
2. Hugging Face ``GradientCheckpointingLayer`` modules, innermost ones (Swin stages hold
   Swin layers: the layers are the blocks, which gives 2·depth units instead of 4), unless the
   outer layer does a layer's worth of work besides them (NOTE [Nested layers]), and the layers
   listed beside them in their list (NOTE [A layer's list]);
3. otherwise the modules of ``nn.ModuleList`` containers whose items share a class, taking
   the class with the most such items (nested lists such as stages → layers included; a list of
   lists gives the inner lists' items, never the lists, which are never called), among classes
   that hold a layer's parameters (NOTE [A model's lists]).

# NOTE [No KV cache in training]
Every block's training forward runs without a KV cache, whatever the plan. A block that
may run twice (checkpoint recompute, the warm-up probe, a reactive eviction) cannot write
one: the cache would hold every key twice, as Hugging Face's own checkpointing knows (it
drops the cache too, unless the layer declares ``_can_checkpoint_with_cache``). And a
block that does write one computes attention on the cache's concatenated copy of its keys
and values, whose rounding differs from the uncached path: checkpointed and
un-checkpointed blocks would not give bitwise equal gradients. A training step never reads
the cache, and the copy costs memory.

# NOTE [Compiled blocks]
With ``compile`` (``fit(..., compile=True)`` or a dict of ``torch.compile`` arguments) each
block's body (its class's forward) is compiled by ``torch.compile`` inside the wrapper, and
every treatment stays outside it: ``recompute`` runs the compiled body again under
``torch.utils.checkpoint``, ``offload`` and the counter see the compiled graph's saved tensors
through their saved-tensor hooks (AOTAutograd saves them with ``save_for_backward``). So
gradients are those of the same compiled model without memfit, and the memory model measures
what the compiled graph saves. The compiled code is shared by alike blocks (torch.compile
guards on their code, not on the instance), and a block's first call compiles, so the first
warm-up step takes the compile time.

``selective`` on a compiled block runs a second compilation of the body whose graphs are
partitioned under ``torch._functorch.config.activation_memory_budget`` (the compile argument
``activation_memory_budget``, default :data:`SELECTIVE_BUDGET`): the partitioner saves that
share of what the plain compilation saves, choosing by min-cut which ops backward recomputes
(the cheap elementwise ones first). The eager policy cannot serve there: it reads the ops a
block dispatches, which a compiled graph does not. The budget is bound to the second
compilation's backend, so the two compilations keep separate graphs for one code object
(Dynamo matches a cached graph to its backend object: one budgeted backend serves every block
of a run, or each block would compile anew) and a plan switches between them freely. Both
run the same decomposed ops; the second recomputes some of them in backward. An op that
draws random numbers must never be among them: run again in backward, it would draw another
mask. The partitioner keeps from recompute only the random ops it lists by name, not
inductor's seed generation, so a graph that draws random numbers (a dropout, an attention with
dropout) is partitioned under the budget 1, as the first, and keeps what ``keep`` keeps. So
the probe first runs a compiled block's eager body once, without autograd, under a dispatch
mode that notes such ops (``treatments.runs_random``): a block that draws is never offered
``selective``, and its second compilation never runs (a plan that names it anyway runs the
budget-1 partition). An inductor joint-graph pass of memfit's sets the budget per graph,
which is why compiled ``selective`` needs the ``inductor`` backend. Gradients under it are
those of compiled ``none`` up to how the code generator rounds a recomputed intermediate
against a stored one (inductor keeps fused bf16 intermediates in float32 unless
``emulate_precision_casts``), as between torch.compile's own budgets.

With compiled blocks the model's loss function is compiled too, with the blocks' arguments:
transformers' settable ``loss_function`` of the outermost module that has one (the compile
option ``loss`` False leaves it eager). The cross-entropy of a causal LM then runs as one graph
whose softmax is recomputed in backward rather than kept (of bf16 logits, the partitioner of the
graph with dynamic sizes, which every length runs, may keep their float32 upcast instead, as the
inductor tests measure; NOTE [Dynamic batch and length]); gradients are
those of the same model compiled the same way without memfit. ``remove()`` puts the model's
own loss function back.

# NOTE [Dynamic batch and length]
A compiled body is called with a new batch size or length on most steps of a run with dynamic
padding, and Dynamo compiles a first call for its exact sizes, then (automatic dynamic) a second
variant when one changes, and a third when the other first changes: compiles in steady steps,
seconds each on a GPU. So each compiled callable (a block's two compilations, the loss) marks the
batch and length dimensions of its inputs dynamic at every call, whoever calls it (the warm-up
probe calls a block's body directly, not through its treatment), before Dynamo sees them
(``torch._dynamo.maybe_mark_dynamic``: a hint, never an error where the code needs a size
static): all dimensions but the last of the first tensor (its features; the loss's first is the
logits), and each dimension of the other tensors (masks, rotary tables, position ids, labels)
whose size is one of those. The first call then compiles the variant every later size reuses. A
size of 1 stays specialised (Dynamo's rule). A feature size that equals the batch or the length
(a rotary table's head dimension at a length of 64) would be marked too, and a call marking more
dimensions than its graph was compiled with compiles another: so each callable remembers the
dimensions its calls have shown with another size, and never marks them again (one marked at the
first call, by such a coincidence, leaves a graph that later calls, marking fewer, still match).
Rule: one graph per compiled callable and input guard (treatment, grad of the input), none per
size.

What marking cannot remove is a guard the compiler itself takes on a size to choose its code
(inductor's C++ code generator sums more than 4,096 rows in chunks; its CUDA attention lowering
asks whether a mask's rows are aligned to 8 elements; its scheduler fuses by batch x length):
each side of such a guard is compiled once, at the first size on that side. Warm-up compiles
the sides below its steps' sizes (NOTE [Guard sides in warm-up], guard_sides.py). Marking sizes
unbacked (no guard at all) breaks the trace where the model's code branches on a length
(transformers' attention does).

# NOTE [Recompile limit]
Dynamo keeps the compiled variants of one code object in one list, shared by every
``torch.compile`` of it, and once the list holds ``recompile_limit`` entries it runs the frame
eagerly for any new variant: here an eager block, which saves what the plans never priced (more
memory, more time, an OOM). A block's body has a variant per side of the compiler's size guards
(NOTE [Dynamic batch and length]), as the user's own compile of the model would, and per input
guard, which a whole-model compile does not have: under LoRA or frozen embeddings the first
block's input needs no gradient and the others' do. memfit compiles the body twice
(``selective``'s second compilation), which doubles them again. So memfit's compilations of a
block's body get four times the limit the user's own compile would have (their
``recompile_limit`` option, else Dynamo's config; Qwen2.5-1.5B's shape has six sides on a GPU,
24 variants under LoRA with ``selective``): passed to ``torch.compile`` where it takes one, else
Dynamo's config raised to it while the blocks are wrapped, and put back when they are unwrapped
(if nothing changed it since).

# NOTE [Switch is read at call time]
The wrapper replaces the block's ``forward`` on the *instance* (the class is untouched) and
reads its ``treatment`` (engine/parts/treatments/) every call, so a plan can change between steps without
re-wrapping and ``unwrap`` restores the model exactly by deleting the instance attribute. A
treatment applies only while the block is training and grad is enabled: eval and ``no_grad``
forwards are untouched.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import re
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from memfit.errors import UserError
from memfit.engine.parts.buffers import buffer_versions, stateful_buffers
from memfit.engine.parts.guard_sides import GuardSides, graphs_made, input_tensors
from memfit.engine.parts.treatments import Keep, Treatment, draws_random

__all__ = [
    "NoBlocksError", "Block", "find_blocks", "wrap_blocks", "unwrap_blocks", "without_cache", "fingerprint",
    "SELECTIVE_BUDGET", "compile_loss", "compile_clock", "DynamicDims",
]

#: how a block runs until a plan says otherwise (stateless: shared)
_PLAIN = Keep()
#: the activation memory budget of a compiled block's ``selective`` body (NOTE [Compiled blocks])
SELECTIVE_BUDGET = 0.5
#: keys of ``fit``'s ``compile`` dict that are memfit's, not ``torch.compile``'s
MEMFIT_COMPILE_KEYS = ("activation_memory_budget", "loss")


def _torch_compile_kwargs(options: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in options.items() if k not in MEMFIT_COMPILE_KEYS}


#: how many times memfit compiles a block's body: plain, and under the activation budget
COMPILATIONS = 2
#: input signatures of a block's body: under LoRA or frozen embeddings the first block's input needs
#: no gradient where the others' do (NOTE [Recompile limit])
INPUT_SIGNATURES = 2


def _compile_takes_limit() -> bool:
    return "recompile_limit" in inspect.signature(torch.compile).parameters


def _with_recompile_limit(options: dict[str, Any]) -> tuple[dict[str, Any], tuple[int, int] | None]:
    """``options`` with the recompile limit memfit's compilations of a block's body need (NOTE
    [Recompile limit]), and, on a torch whose ``torch.compile`` takes none, Dynamo's limit
    before and after memfit raised it instead (None where it did not)."""
    import torch._dynamo

    limit = COMPILATIONS * INPUT_SIGNATURES * (options.get("recompile_limit") or torch._dynamo.config.recompile_limit)
    if _compile_takes_limit():
        return {**options, "recompile_limit": limit}, None
    before = torch._dynamo.config.recompile_limit
    if before >= limit:
        return options, None
    torch._dynamo.config.recompile_limit = limit
    return options, (before, limit)


#: torch's timers of compilation: Dynamo's (which holds the forward's and, for a graph with dynamic
#: sizes, the backward's) and AOTAutograd's lazy backward (a static graph's, at its first backward)
_COMPILE_TIMERS = ("_compile.compile_inner", "backward._backward_impl")


def compile_clock() -> tuple[float, int]:
    """Seconds torch has spent compiling in this process, backward graphs included, and the
    graphs Dynamo has made (both only grow): a step's compile time and new graphs are the
    difference across it."""
    from torch._dynamo.utils import compilation_time_metrics

    seconds = sum(sum(compilation_time_metrics.get(timer, ())) for timer in _COMPILE_TIMERS)
    return seconds, graphs_made()


class DynamicDims:
    """Marks the batch and length dimensions of one compiled callable's inputs dynamic at each call
    (NOTE [Dynamic batch and length]), remembering the dimensions its calls have shown to be
    neither."""

    def __init__(self) -> None:
        #: per layout of the inputs (each tensor's number of dimensions): (tensor, dim) seen with a
        #: size above 1 that was neither the batch nor the length
        self._features: dict[tuple[int, ...], set[tuple[int, int]]] = {}

    def __call__(self, args: tuple, kwargs: dict[str, Any]) -> None:
        import torch._dynamo

        tensors = input_tensors(args, kwargs)
        if not tensors or tensors[0].dim() < 2:
            return
        sizes = {s for s in tensors[0].shape[:-1] if s > 1}
        features = self._features.setdefault(tuple(t.dim() for t in tensors), set())
        features.update((i, d) for i, t in enumerate(tensors) for d, s in enumerate(t.shape) if s > 1 and s not in sizes)
        for i, t in enumerate(tensors):
            last = t.dim() - 1 if i == 0 else t.dim()  # the first tensor's last dimension is its features
            for dim in range(last):
                if t.shape[dim] in sizes and (i, dim) not in features:
                    torch._dynamo.maybe_mark_dynamic(t, dim)


def _marking(compiled: Callable[..., Any], sides: GuardSides | None = None, code: Any = None) -> Callable[..., Any]:
    """``compiled`` marking its inputs' batch and length dimensions dynamic at every call, whoever
    calls it (NOTE [Dynamic batch and length]), and in warm-up compiling the sides of its size
    guards through ``sides`` (NOTE [Guard sides in warm-up], guard_sides.py; ``code``: what is
    compiled and how, shared by the blocks whose compiled code is shared)."""

    mark = DynamicDims()

    @functools.wraps(compiled)
    def body(*args: Any, **kwargs: Any) -> Any:
        if sides is not None:
            return sides.call(compiled, code, mark, args, kwargs)
        mark(args, kwargs)
        return compiled(*args, **kwargs)

    return body


def _code(fn: Callable[..., Any]) -> Any:
    """What Dynamo caches ``fn``'s graphs under: its code object (shared by a class's instances)."""
    return getattr(fn, "__code__", None) or id(fn)


class _LossHandle:
    """Puts a model's own loss function back, as a hook's handle removes the hook."""

    def __init__(self, owner: nn.Module, before: dict[str, Any]):
        self.owner = owner
        self.added = [k for k in owner.__dict__ if k not in before]
        self.changed = {k: v for k, v in before.items() if owner.__dict__.get(k) is not v}

    def remove(self) -> None:
        for key in self.added:
            self.owner.__dict__.pop(key, None)
        self.owner.__dict__.update(self.changed)


def compile_loss(model: nn.Module, options: dict[str, Any] | None, sides: GuardSides | None = None) -> list[_LossHandle]:
    """With compiled blocks, the model's loss function compiled too (NOTE [Compiled blocks]):
    transformers' settable ``loss_function`` of the outermost module that has one. Returns the
    handle that puts the model's own back, or none where there is nothing to compile (eager
    blocks, the option ``loss`` False, no such loss function)."""
    if options is None or not options.get("loss", True):
        return []
    owner = next((m for m in model.modules() if getattr(getattr(type(m), "loss_function", None), "fset", None)), None)
    if owner is None:
        return []
    before = dict(owner.__dict__)
    loss = owner.loss_function
    owner.loss_function = _marking(torch.compile(loss, **_torch_compile_kwargs(options)), sides, (_code(loss), "loss"))
    return [_LossHandle(owner, before)]


class _Budgeted:
    """A ``torch.compile`` backend whose graphs are partitioned under ``activation_memory_budget``
    ``budget`` (NOTE [Compiled blocks]); anything else it is asked is the wrapped backend's."""

    def __init__(self, backend: Any, budget: float):
        self.backend = backend
        self.budget = budget

    def __call__(self, gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
        import torch._functorch.config as functorch_config

        with functorch_config.patch(activation_memory_budget=self.budget):
            return self.backend(gm, example_inputs, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name == "backend":
            raise AttributeError(name)
        return getattr(self.backend, name)


@functools.cache
def _random_graphs_whole_pass() -> type:
    """The class of inductor's joint-graph pass that sets the partitioner's budget back to 1
    for a graph that draws random numbers (NOTE [Compiled blocks])."""
    import torch._functorch.config as functorch_config
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    from memfit.engine.parts.random_ops import __file__ as random_ops_file

    class RandomGraphsWhole(CustomGraphPass):
        def __init__(self, then: Any = None):
            self.then = then  # a pass the user gave, run first

        def __call__(self, graph: torch.fx.Graph) -> None:
            if self.then is not None:
                self.then(graph)
            if any(n.op == "call_function" and draws_random(n.target, n.args, n.kwargs) for n in graph.nodes):
                functorch_config.activation_memory_budget = 1.0  # inside _Budgeted's patch, which restores it

        def uuid(self) -> Any:
            # inductor's caches key a graph on this: the pass's own code (blocks.py, and
            # parts/random_ops.py for draws_random) and the user's pass
            then = self.then.uuid() if hasattr(self.then, "uuid") else self.then
            return (get_hash_for_files((__file__, random_ops_file)), then)

    return RandomGraphsWhole


def _budgeted_backend(options: dict[str, Any]) -> tuple[_Budgeted, dict[str, Any]]:
    """The backend of ``torch.compile(**options)`` (resolved as ``torch.compile`` does)
    partitioning under ``options``' ``activation_memory_budget`` (1 for a graph that draws random
    numbers), and the other ``torch.compile`` arguments. One is made per run and shared by the
    blocks: Dynamo matches a cached graph to its backend object, so a backend per block would
    compile every block anew, up to its recompile limit."""
    budget = options.get("activation_memory_budget", SELECTIVE_BUDGET)
    rest = {k: v for k, v in _torch_compile_kwargs(options).items() if k not in ("backend", "mode", "options")}
    backend, mode, inductor = options.get("backend", "inductor"), options.get("mode"), options.get("options")
    if backend == "inductor":
        inductor = dict(inductor or {})
        inductor["joint_custom_post_pass"] = _random_graphs_whole_pass()(inductor.get("joint_custom_post_pass"))
        resolved = torch._TorchCompileInductorWrapper(mode, inductor, options.get("dynamic"))
    else:
        resolved = torch._TorchCompileWrapper(backend, mode, inductor, options.get("dynamic"))
    return _Budgeted(resolved, budget), rest


class NoBlocksError(UserError, ValueError):
    """The model has no module memfit can checkpoint."""


class Block:
    """One checkpointable module with its treatment and counters.

    Attributes:
        index: position in the model's block list (execution order).
        name: qualified module name.
        module: the wrapped module.
        treatment: how the block runs its next training forward (engine/parts/treatments/); it calls
            :meth:`run_body` for each run of the body, recomputes included.
        forwards: training forwards run (whatever the treatment).
        runs: times the block's body actually ran; ``runs - forwards`` are recomputes.
        listener: told ``enter(block, args, kwargs)`` at the start of every training forward
            and ``exit(block)`` at its end (the runtime uses it to fix the plan before the
            first block and to attribute saved tensors to blocks).
        on_oom: when set, an OOM in a training forward of the block is not raised: the block
            returns ``on_oom(block, args, kwargs, message)`` instead (NOTE [Replay under FSDP]
            in engine/run/replay.py).
        before_run: when set, called as ``before_run(block)`` before every run of the body,
            recomputes included (the runtime reads the start-of-backward peak at the first
            recompute: NOTE [Reading the backward's start] in learner.py).
    """

    def __init__(self, index: int, name: str, module: nn.Module):
        self.index = index
        self.name = name
        self.module = module
        self.treatment: Treatment = _PLAIN
        self.forwards = 0
        self.runs = 0
        #: its buffers' version counters at ``fit``, and the buffers its forwards may change once a run has shown them
        #: (NOTE [Running statistics], buffers.py)
        self._buffer_versions = buffer_versions(module)
        self._stateful: list[torch.Tensor] | None = None
        #: whether its input is read channels first (NOTE [What the key cannot see], shapes.py)
        self.channels_first = _starts_with_convolution(module)
        self.listener: BlockListener | None = None
        self.before_run: Callable[[Block], None] | None = None
        self.on_oom: Callable[[Block, tuple, dict, str], Any] | None = None
        #: runs a forward without autograd where set: ``evaluation(block, args, kwargs)`` (NOTE [Blocks in evaluation])
        self.evaluation: Callable[[Block, tuple, dict], Any] | None = None
        self.body = module.forward  # the class's forward, bound to the instance
        self.lean_body: Callable[..., Any] | None = None
        self.eager_body: Callable[..., Any] = self.body
        self.compiled = False
        #: whether the body draws random numbers (measured once, by the probe of a compiled block)
        self.draws_random: bool | None = None
        #: whether its MLPs tiled in one chunk give the plain body's outputs and gradients bit for bit (measured
        #: once, by the tiled treatments' probe: NOTE [Tiled MLP]); False: nothing of it is tiled
        self.tiles_exactly: bool | None = None
        #: whether its plain body's gradients come out bit for bit twice: False (a kernel that sums with atomics) once a
        #: bit-for-bit check found them not to, and its later checks go by the outputs (``runs_as_plain``)
        self.repeats_gradients = True
        #: Dynamo's recompile limit before and after wrapping raised it (NOTE [Recompile limit])
        self.raised_limit: tuple[int, int] | None = None

    def compile(self, options: dict[str, Any], lean: tuple[Any, dict[str, Any]], sides: GuardSides | None = None) -> None:
        """Run the body compiled by ``torch.compile(**options)``, and ``selective`` a second
        compilation by the run's budgeted backend ``lean`` (:func:`_budgeted_backend`; NOTE
        [Compiled blocks]); ``sides``: the run's sweep of guard sides (guard_sides.py)."""
        code = _code(self.eager_body)
        self.body = _marking(torch.compile(self.eager_body, **_torch_compile_kwargs(options)), sides, (code, "body"))
        backend, rest = lean
        self.lean_body = _marking(torch.compile(self.eager_body, backend=backend, **rest), sides, (code, "lean"))
        self.compiled = True

    @property
    def recomputes(self) -> int:
        return self.runs - self.forwards

    def stateful_buffers(self) -> list[torch.Tensor]:
        """The buffers its forwards may change, to restore after a re-run or a probe (NOTE [Running statistics],
        buffers.py): read again until the body has run once (an in-place update moves a version only then), then kept."""
        if self._stateful is not None:
            return self._stateful
        found = stateful_buffers(self.module, self._buffer_versions)
        if self.runs:
            self._stateful = found
        return found

    def run_body(self, *args: Any, **kwargs: Any) -> Any:
        return self._run(self.body, args, kwargs)

    def run_lean(self, *args: Any, **kwargs: Any) -> Any:
        """Run the body compiled under the activation memory budget (compiled blocks only:
        NOTE [Compiled blocks])."""
        return self._run(self.lean_body, args, kwargs)

    def _run(self, body: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        """One run of the body (recomputes included): counted, announced to ``before_run``."""
        self.runs += 1
        if self.before_run is not None:
            self.before_run(self)
        return body(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        active = self.module.training and torch.is_grad_enabled()
        if not active:
            return self.body(*args, **kwargs) if self.evaluation is None else self.evaluation(self, args, kwargs)
        self.forwards += 1
        listener = self.listener
        if listener is not None:
            listener.enter(self, args, kwargs)
        out = None
        try:
            args, kwargs = without_cache(self.module, args, kwargs)  # NOTE [No KV cache in training]
            try:
                out = self.treatment.run(self, args, kwargs)
                return out
            except torch.OutOfMemoryError as err:
                if self.on_oom is None:
                    raise
                message = str(err)  # handled outside the except block, so the failed frames are freed
            out = self.on_oom(self, args, kwargs, message)
            return out
        finally:
            if listener is not None:
                listener.exit(self, out)


@functools.cache
def _cache_type() -> type | None:
    """transformers' KV-cache base class, looked up once (None without transformers)."""
    try:
        from transformers.cache_utils import Cache
    except ImportError:
        return None
    return Cache


def _is_cache(value: Any) -> bool:
    cache = _cache_type()
    return cache is not None and isinstance(value, cache)


def without_cache(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """Drop KV-cache arguments from a training forward (NOTE [No KV cache in training]).

    Caches are found by type, whatever their name or position (GPT-2 passes one
    positionally; transformers renamed ``past_key_values`` to ``cache``), and by the
    older names when given as something else (a legacy tuple).
    """
    if getattr(module, "_can_checkpoint_with_cache", False):
        return args, kwargs
    args = tuple(None if _is_cache(a) else a for a in args)
    out = dict(kwargs)
    if out.get("use_cache"):
        out["use_cache"] = False
    for name, value in kwargs.items():
        if value is not None and (_is_cache(value) or name in ("past_key_values", "past_key_value", "layer_past")):
            out[name] = None
    return args, out


class BlockListener(Protocol):
    """What a :class:`Block` tells about its training forwards."""

    def enter(self, block: Block, args: tuple, kwargs: dict) -> None: ...

    def exit(self, block: Block, output: Any = None) -> None: ...


def _gradient_checkpointing_layer_type() -> type | None:
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # transformers absent or older than the class
        return None
    return GradientCheckpointingLayer


def _module_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0]


def _describe_candidates(model: nn.Module) -> str:
    lists = _module_lists(model)
    if not lists:
        return "the model has no nn.ModuleList at all"
    parts = []
    for name, ml in lists:
        classes = Counter(type(m).__name__ for m in ml)
        parts.append(f"{name or '<root>'}: " + ", ".join(f"{cls}×{count}" for cls, count in classes.items()))
    return "module lists seen: " + "; ".join(parts)


def find_blocks(model: nn.Module, blocks: Sequence[nn.Module] | str | None = None) -> list[tuple[str, nn.Module]]:
    """Return ``(name, module)`` for each checkpointable block, in module order.

    Args:
        model: the model.
        blocks: optional override: a sequence of submodules, or a regular expression matched
            (``re.fullmatch``) against qualified module names, e.g. ``r"encoder\\.layer\\.\\d+"``.

    Raises:
        NoBlocksError: listing the module lists seen, when nothing qualifies or the override
            matches nothing.

    Example:
        >>> from torch import nn
        >>> m = nn.Sequential(nn.ModuleList([nn.Linear(4, 4) for _ in range(3)]))
        >>> [n for n, _ in find_blocks(m)]
        ['0.0', '0.1', '0.2']
    """
    named = list(model.named_modules())
    if blocks is not None:
        if isinstance(blocks, str):
            pattern = re.compile(blocks)
            found = [(n, m) for n, m in named if n and pattern.fullmatch(n)]
            what = f"pattern {blocks!r}"
        else:
            ids = {id(b) for b in blocks}
            found = [(n, m) for n, m in named if id(m) in ids]
            if len(found) != len(ids):
                raise NoBlocksError("some modules given as blocks= are not submodules of the model")
            what = "blocks="
        if not found:
            raise NoBlocksError(f"{what} matched no module; {_describe_candidates(model)}")
        return _outermost(found)

    gc_type = _gradient_checkpointing_layer_type()
    if gc_type is not None:
        order = {id(m): (i, n) for i, (n, m) in enumerate(named)}
        layers = [m for _, m in named if isinstance(m, gc_type)]
        units = [u for m in _top_layers(layers, layers) for u in _units(m, gc_type)]
        units += _listed_beside(model, units)
        if units:
            return [(order[id(m)][1], m) for m in sorted(units, key=lambda m: order[id(m)][0])]

    counts: Counter[type] = Counter()
    weights: Counter[type] = Counter()
    for _, ml in _module_lists(model):
        items = list(ml)
        if items and all(isinstance(m, _CONTAINERS) for m in items):  # a list of lists: their items, one sequence
            items = [c for m in items for c in (m.values() if isinstance(m, nn.ModuleDict) else m)]
        kind = _one_class(items)
        if kind is not None:
            counts[kind] += len(items)
            weights[kind] += sum(p.numel() for m in items for p in m.parameters())
    heaviest = max(weights.values(), default=0)
    counts = Counter({c: n for c, n in counts.items() if weights[c] * LIGHT_LIST >= heaviest})  # NOTE [A model's lists]
    if not counts:
        raise NoBlocksError(
            "found no checkpointable blocks (no GradientCheckpointingLayer, no nn.ModuleList of "
            f"same-class modules); {_describe_candidates(model)}. Pass blocks= (modules or a name "
            "pattern) to memfit.fit."
        )
    most = max(counts.values())
    best = {c for c, n in counts.items() if n == most}
    return _outermost([(n, m) for n, m in named if type(m) in best])


# NOTE [A model's lists]
# A model without checkpointing layers is planned by its module lists: the class whose same-class lists hold the
# most items. XLM and FlauBERT keep a layer's parts in parallel lists (attentions, norms, feed-forward networks,
# norms again), so the norms, two a layer, were the blocks: 1% of the parameters, nothing worth saving. A list
# whose items hold under a tenth of the heaviest list's parameters (norms, activations) is no layer: it is not
# counted. And parallel lists of a layer's parts are equally long, so every class tied on the most items gives
# blocks (XLM's attentions and feed-forward networks; an encoder's and a decoder's layers of one depth).
#: a class of listed modules counts only with at least 1 / LIGHT_LIST of the heaviest class's parameters
LIGHT_LIST = 10


#: modules that hold others and are never called: a list of lists (Funnel's stages of layers) gives its layers
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def _top_layers(layers: list[nn.Module], within: list[nn.Module]) -> list[nn.Module]:
    """Those of ``layers`` inside none of the others of ``within``."""
    inside = {id(c) for m in within for c in m.modules() if c is not m}
    return [m for m in layers if id(m) not in inside]


def _units(layer: nn.Module, gc_type: type) -> list[nn.Module]:
    """The blocks ``layer`` gives: itself, or the blocks of the layers it holds (NOTE [Nested layers]).

    # NOTE [Nested layers]
    A checkpointing layer that holds others is usually a stage of them (Swin's stage: its layers and a
    patch merging), and its layers are the blocks: more units, each a smaller treatment. But some hold a
    layer beside a layer's worth of their own work (Zamba 2's hybrid layer: a shared transformer, attention
    and MLP, beside a Mamba layer). Taken apart, that work would be in no block: never treated, and the
    floor higher by it. So a layer is a block of its own where the parameters it holds outside its inner
    layers number at least its smallest inner layer's; else its inner layers are, by the same rule.

    A stage whose layers transformers does not checkpoint (Swin V2's, Donut's and MaskFormer's Swin stages,
    FocalNet's) holds them in a list of its own, its direct child: there the list's items are its inner layers,
    by the same rule. Whole, such a stage is one checkpoint over up to eighteen layers, whose backward holds
    them all at once again. A list deeper down is no stage's (a mixture's experts, under its MLP), and a
    layer whose own work outweighs an item of its list (MobileBERT's attention beside its stacked
    feed-forward networks) stays whole."""
    nested = [c for c in layer.modules() if c is not layer and isinstance(c, gc_type)]
    inner = _top_layers(nested, nested) or _listed_layers(layer)
    if not inner:
        return [layer]
    held = {id(p): p.numel() for i in inner for p in i.parameters()}
    own = sum(p.numel() for p in layer.parameters() if id(p) not in held)
    if own >= min(sum(p.numel() for p in i.parameters()) for i in inner):
        return [layer]
    return [u for i in inner for u in _units(i, gc_type)]


def _one_class(items: list[nn.Module]) -> type | None:
    """The class of ``items`` where they are two or more modules of one class, none a container; else None."""
    classes = {type(m) for m in items}
    kind = classes.pop() if len(classes) == 1 else None
    return kind if len(items) >= 2 and kind is not None and not issubclass(kind, _CONTAINERS) else None


def _listed_layers(layer: nn.Module) -> list[nn.Module]:
    """The items of ``layer``'s own list of layers (NOTE [Nested layers]): of its direct children that are lists, the
    one of two or more modules of one class, each with parameters, that holds the most parameters; none without."""
    best, most = [], 0
    for child in layer.children():
        items = list(child) if isinstance(child, nn.ModuleList) else []
        if _one_class(items) is not None and all(next(m.parameters(), None) is not None for m in items):
            held = sum(p.numel() for m in items for p in m.parameters())
            if held > most:
                best, most = items, held
    return best


def _starts_with_convolution(module: nn.Module) -> bool:
    """Whether the first of ``module``'s layers with parameters of their own is a convolution (its input channels first)."""
    for m in module.modules():
        if next(m.parameters(recurse=False), None) is not None:
            return isinstance(m, nn.modules.conv._ConvNd)
    return False


def _listed_beside(model: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    """The items listed beside ``units`` that are blocks too (NOTE [A layer's list]).

    # NOTE [A layer's list]
    A list that holds checkpointing layers usually holds nothing else, but a model may list beside them layers
    transformers does not checkpoint (MobileViT's first two stages, MobileNet layers, before its MobileViT layers).
    They run in the same loop, one after another; left out, they are in no block: never treated, and the floor higher
    by their activations (9.0 of a tiny MobileViT's 12.9 MB at 64 x 64: ``full``'s peak fell from 10.4 MB to 1.7 with
    them). So an item of a list that holds a block is a block too where it has parameters, holds no block and is in
    none, and is no container (a list is never called)."""
    ids = {id(u) for u in units}
    within = {id(c) for u in units for c in u.modules()}
    beside = []
    for _, listed in _module_lists(model):
        items = list(listed)
        if not any(id(m) in ids for m in items):
            continue
        beside += [m for m in items if id(m) not in within and not isinstance(m, _CONTAINERS)
                   and next(m.parameters(), None) is not None and not any(id(c) in ids for c in m.modules())]
    return beside


def _outermost(found: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Drop blocks nested inside another block: checkpointing both would recompute twice."""
    names = [n for n, _ in found]
    return [(n, m) for n, m in found if not any(n.startswith(o + ".") for o in names if o != n)]


def wrap_blocks(
    named_blocks: list[tuple[str, nn.Module]], allow_hf_checkpointing: bool = False, compile: dict[str, Any] | None = None,
    sides: GuardSides | None = None,
) -> list[Block]:
    """Install a :class:`Block` switch on each module (see NOTE [Switch is read at call time]).

    Args:
        named_blocks: ``(name, module)`` pairs from :func:`find_blocks`.
        allow_hf_checkpointing: accept modules whose Hugging Face checkpointing is on (for a
            method that never checkpoints: memfit then only measures, as for the peers of
            the benchmark).
        compile: ``torch.compile`` arguments to compile each block's body with (NOTE
            [Compiled blocks]); ``None`` runs the bodies eagerly.
        sides: the run's sweep of guard sides, which compiled bodies call (NOTE [Guard sides in
            warm-up], guard_sides.py).

    Raises:
        ValueError: if a module is already wrapped, or HF gradient checkpointing is on.
    """
    for name, module in named_blocks:
        if isinstance(module.__dict__.get("forward"), Block):
            raise ValueError(f"block {name} is already wrapped by memfit; call remove() on the old controller")
        if getattr(module, "gradient_checkpointing", False) and not allow_hf_checkpointing:
            raise ValueError(
                f"Hugging Face gradient checkpointing is on for {name}; memfit decides what to "
                "checkpoint: call model.gradient_checkpointing_disable() (or drop "
                "--gradient_checkpointing) and use method 'full' for the same effect"
            )
    raised = None
    if compile is not None:
        compile, raised = _with_recompile_limit(compile)
    lean = _budgeted_backend(compile) if compile is not None else None
    wrapped: list[Block] = []
    try:
        for i, (name, module) in enumerate(named_blocks):
            block = Block(i, name, module)
            block.raised_limit = raised
            if lean is not None:
                block.compile(compile, lean, sides)
            module.forward = block
            wrapped.append(block)
    except BaseException:
        unwrap_blocks(wrapped)  # all or nothing (NOTE [Setup is all or nothing], controller.py)
        raise
    return wrapped


def fingerprint(named_blocks: list[tuple[str, nn.Module]]) -> str:
    """A short hash of the blocks: their names, classes and parameter counts, in order.

    Plans made for one model are refused on another (NOTE [Plans files] in methods/precomputed.py).

    Example:
        >>> from torch import nn
        >>> fingerprint([("0", nn.Linear(4, 4))]) == fingerprint([("0", nn.Linear(4, 4))])
        True
    """
    h = hashlib.sha1()
    for name, module in named_blocks:
        h.update(f"{name}:{type(module).__name__}:{sum(p.numel() for p in module.parameters())};".encode())
    return h.hexdigest()[:12]


def unwrap_blocks(blocks: list[Block]) -> None:
    """Restore every module's own ``forward``, and Dynamo's recompile limit if wrapping them
    raised it and nothing changed it since (NOTE [Recompile limit])."""
    for block in blocks:
        if block.module.__dict__.get("forward") is block:
            del block.module.forward
    raised = blocks[0].raised_limit if blocks else None
    if raised is not None:
        import torch._dynamo

        if torch._dynamo.config.recompile_limit == raised[1]:
            torch._dynamo.config.recompile_limit = raised[0]
        for block in blocks:
            block.raised_limit = None
