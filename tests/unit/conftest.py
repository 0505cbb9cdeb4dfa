import os

# Unit tests exercise the CPU paths, also on a machine with a GPU (tests/gpu covers CUDA).
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import pytest  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402


@pytest.fixture
def fake_world():
    """A fake process group of `world` ranks in this one process (this process is rank `rank`)."""

    def init(world: int, rank: int = 0) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()
