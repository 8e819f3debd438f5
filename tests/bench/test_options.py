import pytest

from headkit.bench.lora import LoraConfig
from headkit.bench.registry import check_options
from headkit.errors import HeadkitError
from headkit.runs.options import check_integers


@pytest.mark.parametrize("bad", [0, -3e-3, True, "4", None, float("inf"), float("nan")])
def test_a_non_positive_number_is_refused_naming_the_option(bad):
    check_options(LoraConfig(lr=1e-3, lora_lr=2))
    with pytest.raises(HeadkitError, match=r"^--lora-lr must be a positive number"):
        check_options(LoraConfig(lr=1e-3, lora_lr=bad))


@pytest.mark.parametrize("bad", [(), [0, 1], (1, True), (1, 2.0), "12", (1, 1001)])
def test_integer_lists_are_checked_against_their_bounds(bad):
    check_integers("--images", (1, 1000), 1, 1000)
    with pytest.raises(HeadkitError, match=r"^--images must be one or more integers in \[1, 1000\]"):
        check_integers("--images", bad, 1, 1000)
    with pytest.raises(HeadkitError, match="--ranks names a value twice"):
        check_integers("--ranks", (4, 2, 4), distinct=True)
