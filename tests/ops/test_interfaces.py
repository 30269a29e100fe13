"""Every backend in the backend table implements its operator's interface and declares its capabilities as
class attributes; the operator and backend names come from that one table."""
import pytest

from moeserve import backends
from moeserve.config import BackendConfig
from moeserve.ops.interfaces import INTERFACES


@pytest.mark.parametrize("spec", [s for specs in backends.SPECS.values() for s in specs], ids=lambda s: f"{s.op}-{s.name}")
def test_each_backend_class_subclasses_its_interface(spec):
    cls = backends.load(spec)
    assert issubclass(cls, INTERFACES[spec.op]), f"{spec.target} does not implement {INTERFACES[spec.op].__name__}"
    assert cls.name == spec.name
    if spec.op == "attention":
        assert isinstance(cls.supports_graphs, bool)
    if spec.op == "moe":
        assert isinstance(cls.serves_fp8, bool)
    if spec.flashinfer_modules:
        assert callable(backends.load_target(spec.flashinfer_modules))
    if "flashinfer" in spec.needs.packages:
        assert spec.flashinfer_modules, f"{spec.op}/{spec.name} loads FlashInfer modules but lists none"


def test_names_come_from_the_one_table():
    assert set(INTERFACES) == set(backends.OPERATORS)
    assert set(BackendConfig.model_fields) == set(backends.OPERATORS)
    for op, names in backends.BACKEND_NAMES.items():
        assert names == tuple(s.name for s in backends.SPECS[op])
