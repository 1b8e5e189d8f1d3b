"""CUDA tensors through the client: device <-> shared region. Needs a GPU."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_put_and_get_cuda_tensors(daemon):
    from kvstore.client import Client
    from tests.conftest import make_spec

    with Client(daemon.address) as c:
        ns = c.declare_namespace(make_spec(64 * 1024))
        blocks = torch.randint(0, 255, (32, 64 * 1024), dtype=torch.uint8, device="cuda")
        assert c.put(ns, list(range(32)), blocks).stored == 32
        out = torch.zeros_like(blocks)
        got = c.get(ns, list(range(32)), out=out)
        assert got.found == 32
        assert torch.equal(out, blocks)
        # and a CPU reader sees the same bytes
        assert torch.equal(torch.from_numpy(c.get(ns, list(range(32))).data), blocks.cpu())
