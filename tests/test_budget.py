import re
import os

import pytest

from memfit.engine.budget import Budget, BudgetTooSmallError, check_static_need, parse_bytes


@pytest.mark.parametrize(
    "text, expected",
    [
        ("6GiB", 6 * 2**30),
        ("6GB", 6 * 10**9),
        ("6 GB", 6 * 10**9),
        ("6KB", 6 * 10**3),
        ("6kB", 6 * 10**3),
        ("1.5GiB", int(1.5 * 2**30)),
        ("512MiB", 512 * 2**20),
        ("300MB", 300 * 10**6),
        ("123456", 123456),
        (4096, 4096),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["6 potatoes", "GiB", "-1GB", -5, True, ""])
def test_parse_bytes_rejects(bad):
    with pytest.raises(ValueError):
        parse_bytes(bad)


# NOTE [A budget as typed], rule 1: a unit only as written; what else it may mean, in bytes
UNREAD_UNITS = [
    ("5gb", r"the unit 'gb' is not one memfit reads \(units are read as written, case included\): write 5GB "
     r"\(5\*10\*\*9 = 5000000000 bytes\) or 5GiB \(5\*2\*\*30 = 5368709120 bytes\)$"),
    ("5 gb", r"write 5GB \(5\*10\*\*9 = 5000000000 bytes\) or 5GiB"),
    ("5Gb", r"the unit 'Gb' .* write 5GB .* or 5GiB"),
    ("5G", r"the unit 'G' .* write 5GB .* or 5GiB"),
    ("1.5mb", r"write 1\.5MB \(1\.5\*10\*\*6 = 1500000 bytes\) or 1\.5MiB \(1\.5\*2\*\*20 = 1572864 bytes\)$"),
    ("512kb", r"write 512kB \(512\*10\*\*3 = 512000 bytes\) or 512KiB"),
    ("5gib", r"the unit 'gib' .*: write 5GiB \(5\*2\*\*30 = 5368709120 bytes\)$"),  # binary, only the case is off
    ("512b", r"write 512B or 512 \(bytes; a b is a bit\)$"),
]


@pytest.mark.parametrize("text, words", UNREAD_UNITS, ids=[u[0] for u in UNREAD_UNITS])
def test_a_unit_not_written_as_in_the_table_is_refused_with_its_readings(text, words):
    with pytest.raises(ValueError, match=rf"^--memory_budget {re.escape(text)}: (.*: )?{words}"):
        Budget.parse(text, "--memory_budget")


@pytest.mark.parametrize("text, words", [
    ("-3GB", "a memory size cannot be negative; write e.g. 3GB"),
    ("0", "a budget of 0 bytes holds nothing; give e.g. 6GB"),
    ("0GiB", "a budget of 0 bytes holds nothing"),
])
def test_a_negative_or_empty_budget_is_refused_as_typed(text, words):
    with pytest.raises(ValueError, match=rf"^--memory_budget {re.escape(text)}: {re.escape(words)}"):
        Budget.parse(text, "--memory_budget")
    with pytest.raises(ValueError, match=rf"^budget={re.escape(repr(text))}: {re.escape(words)}"):
        Budget.parse(text)


# NOTE [A budget as typed], rule 2: as typed with its bytes; other sizes in the family of its unit
BUDGET_WORDS = [
    ("1MB", "1MB (1000000 bytes)", "17.6 MB", ("MB", 10**6)),
    ("5 GB", "5 GB (5000000000 bytes)", "17.6 MB", ("GB", 10**9)),
    ("125MiB", "125MiB (131072000 bytes)", "16.8 MiB", ("MiB", 2**20)),
    ("6GiB", "6GiB (6442450944 bytes)", "16.8 MiB", ("GiB", 2**30)),
    ("2TB", "2TB (2000000000000 bytes)", "17.6 MB", ("GB", 10**9)),
    ("512kB", "512kB (512000 bytes)", "17.6 MB", ("MB", 10**6)),
    ("123456789", "123456789 bytes (117.7 MiB)", "16.8 MiB", ("GiB", 2**30)),
    (1000, "1000 bytes", "16.8 MiB", ("GiB", 2**30)),
]


@pytest.mark.parametrize("given, said, size, column", BUDGET_WORDS, ids=[str(b[0]) for b in BUDGET_WORDS])
def test_a_budget_is_said_as_typed_and_sizes_beside_it_in_its_unit_family(given, said, size, column):
    budget = Budget.parse(given, "--memory_budget")
    assert (str(budget), budget.size(17_600_000), budget.column_unit) == (said, size, column)


def test_static_need_error_states_bytes():
    parts = {"parameters": 400, "gradients": 400, "optimizer state": 800}
    with pytest.raises(BudgetTooSmallError, match=r"1600 bytes: parameters 400 B, gradients 400 B, optimizer state 800 B"):
        check_static_need(Budget(1000), 1600, parts)
    check_static_need(Budget(2000), 1600, parts)  # fits: no error


def test_static_need_error_quotes_the_budget_as_typed_and_names_it_as_given():
    """NOTE [A budget as typed], rules 2 and 3: '1MB (1000000 bytes)', not '976.6 KiB'; the sizes in MB;
    raise what the user gave: --memory_budget on the command line, budget= in Python."""
    parts = {"parameters": 4_400_000, "gradients": 4_400_000, "optimizer state": 8_800_000}
    with pytest.raises(BudgetTooSmallError, match=r"^memory budget 1MB \(1000000 bytes\) is below what training needs "
                       r"before any activation: 17\.6 MB \(17600000 bytes: parameters 4\.4 MB, gradients 4\.4 MB, "
                       r"optimizer state 8\.8 MB\)\. Raise --memory_budget above that"):
        check_static_need(Budget.parse("1MB", "--memory_budget"), 17_600_000, parts)
    with pytest.raises(BudgetTooSmallError, match=r"Raise budget= above that"):
        check_static_need(Budget.parse("1MB"), 17_600_000, parts)


def test_python_api_errors_name_the_argument():
    """A bad budget given to ``memfit.fit`` names the argument (``budget=``), not a CLI flag."""
    import torch

    import memfit

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"^budget='6XB': not a memory size: '6XB'; write e\.g\. '6GiB'"):
        memfit.fit(model, budget="6XB", blocks=[model[0]])
    with pytest.raises(ValueError, match=r"^budget=-1: a memory size cannot be negative"):
        parse_bytes(-1, argument="budget")
    with pytest.raises(ValueError, match=r"^budget='6gb': the unit 'gb' is not one memfit reads"):
        memfit.fit(model, budget="6gb", blocks=[model[0]])


@pytest.mark.parametrize("budget, said", [(100, "100 bytes"), ("100B", "100B (100 bytes)")])
def test_a_budget_too_small_for_memfit_fit_names_budget_not_a_flag(budget, said):
    """NOTE [A budget as typed], rule 3: a Python user is told to raise ``budget=``; the flag is the CLI's."""
    import torch

    import memfit

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(memfit.BudgetTooSmallError, match=rf"^memory budget {re.escape(said)} is below .*Raise budget= above") as error:
        memfit.fit(model, budget=budget, blocks=[model[0]], announce=False)
    assert "--memory_budget" not in str(error.value)


def test_a_cap_turns_expandable_segments_on_unless_the_user_named_them(monkeypatch):
    """NOTE [Expandable segments under a cap]: without them a 1B model's optimizer step ran out of memory at 12 GiB
    in fragments memfit cannot replay. Under a cap the meter turns them on once and says so; allocator settings
    that name them stand, and a torch that refuses them leaves everything as it was."""
    import torch

    from memfit.engine.run import meter

    calls = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    # given with the user's split size, which a string without it would reset (NOTE [The allocator's settings at run time])
    assert meter.expandable_segments_on() and calls == ["max_split_size_mb:128,expandable_segments:True"]
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128,expandable_segments:True"
    assert not meter.expandable_segments_on() and len(calls) == 1  # the settings now name them: said once
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    assert not meter.expandable_segments_on() and len(calls) == 1
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")  # not the caching allocator's to change
    assert not meter.expandable_segments_on() and len(calls) == 1

    def refuse(_):
        raise RuntimeError("expandable_segments not supported on this platform")

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", refuse, raising=False)
    assert not meter.expandable_segments_on() and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ


def test_turning_expandable_segments_on_empties_the_allocators_cache(monkeypatch):
    """NOTE [Expandable segments under a cap]: the fixed segments cached before the cap (a model's setup, FSDP2's
    sharding, an earlier run of the process) go once the segments are made expandable, so the run's allocations
    come from expandable ones; where the user's settings name them, the cache is left as it is."""
    import torch

    from memfit.engine.run import meter

    emptied = []
    monkeypatch.setattr(meter, "apply_cuda_cap", lambda budget, device: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", lambda settings: None, raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    cuda = meter.CudaMeter(torch.device("cuda", 0), [], 0)
    said = cuda.apply_cap(10**9)
    assert "expandable" in said and "before launching" not in said and emptied == [True]
    assert cuda.apply_cap(10**9) is None and emptied == [True]  # the settings now name them: the cache stays


def test_on_several_ranks_the_toggle_says_to_set_expandable_segments_at_launch(monkeypatch):
    """NOTE [Expandable segments under a cap]: a rank's shards were made before the cap, in fixed segments that stay;
    on several ranks the line says to set them before launching (memfit train does)."""
    import torch

    from memfit.engine.run import meter

    monkeypatch.setattr(meter, "apply_cuda_cap", lambda budget, device: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", lambda settings: None, raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    said = meter.CudaMeter(torch.device("cuda", 0), [], 0).apply_cap(10**9)
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before launching" in said
