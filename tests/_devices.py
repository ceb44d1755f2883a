"""The device parameter of the tests that the GPU tier repeats on CUDA (see tests/conftest.py)."""
import pytest

#: `@ON_DEVICES` runs a test with `device='cpu'` in the default suite and with `device='cuda'` in the GPU tier
ON_DEVICES = pytest.mark.parametrize('device', ['cpu', pytest.param('cuda', marks=pytest.mark.gpu)])
