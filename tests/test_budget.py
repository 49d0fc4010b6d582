import pytest

from memfit.engine.budget import BudgetTooSmallError, check_static_need, parse_bytes


@pytest.mark.parametrize(
    "text, expected",
    [
        ("6GiB", 6 * 2**30),
        ("6GB", 6 * 10**9),
        ("6 gb", 6 * 10**9),
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


def test_static_need_error_states_bytes():
    parts = {"parameters": 400, "gradients": 400, "optimizer state": 800}
    with pytest.raises(BudgetTooSmallError, match=r"1600 bytes: parameters 400 B, gradients 400 B, optimizer state 800 B"):
        check_static_need(1000, 1600, parts)
    check_static_need(2000, 1600, parts)  # fits: no error


def test_python_api_errors_name_the_argument():
    """A bad budget given to ``memfit.fit`` names the argument (``budget=``), not a CLI flag."""
    import torch

    import memfit

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"^budget='6XB': not a memory size: '6XB'; write e\.g\. '6GiB'"):
        memfit.fit(model, budget="6XB", blocks=[model[0]])
    with pytest.raises(ValueError, match=r"^budget=-1: a memory size cannot be negative"):
        parse_bytes(-1, argument="budget")
