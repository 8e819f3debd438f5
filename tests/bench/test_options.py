from types import SimpleNamespace

import pytest

from headkit.bench._options import check_positive_option, check_positive_options
from headkit.errors import HeadkitError


@pytest.mark.parametrize("bad", [0, -3, True, 1.5, "4", None])
def test_a_non_positive_integer_is_refused_naming_the_option(bad):
    with pytest.raises(HeadkitError, match=r"^--batch-size must be a positive integer"):
        check_positive_option("batch_size", bad)


def test_every_named_setting_is_checked_and_good_ones_pass():
    check_positive_options(SimpleNamespace(steps=1, layers=12), ("steps", "layers"))
    with pytest.raises(HeadkitError, match="--layers"):
        check_positive_options(SimpleNamespace(steps=1, layers=0), ("steps", "layers"))
