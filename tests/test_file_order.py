"""The order test files are handed to xdist's workers: heaviest first (tests/file_order.py)."""

from __future__ import annotations

from conftest import REPO
from file_order import HEAVY, file_order


def test_heavy_files_go_first_by_cost_then_the_rest_by_their_number_of_tests():
    files = ["test_format.py", "test_sae.py", "test_devices.py", "test_train.py", "test_daemon_death.py",
             "test_spec.py"]
    counts = {"test_format.py": 20, "test_sae.py": 151, "test_devices.py": 54, "test_train.py": 22,
              "test_daemon_death.py": 4, "test_spec.py": 20}
    assert file_order(files, counts) == ["test_train.py", "test_daemon_death.py", "test_sae.py", "test_devices.py",
                                         "test_format.py", "test_spec.py"]


def test_every_file_named_heavy_exists():
    """A renamed or split file would silently lose its place at the front."""
    assert [name for name in HEAVY if not (REPO / "tests" / name).is_file()] == []


def test_the_collection_is_in_that_order(request):
    """This session's own collection (xdist hands the files out in it): whole files, in that order."""
    names = [item.path.name for item in request.session.items]
    files = list(dict.fromkeys(names))
    assert names == sorted(names, key=files.index)  # each file's tests together
    assert files == file_order(files, {f: names.count(f) for f in files})
