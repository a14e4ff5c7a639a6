
import pytest
import torch

from sgl_nb.runtime.kv_pool import KVPool


def make_pool(num_slots: int = 8) -> KVPool:
    return KVPool(num_layers=2, num_slots=num_slots, num_kv_heads=3, head_dim=4)


def test_buffers_shape_and_padding_slot():
    pool = KVPool(num_layers=3, num_slots=10, num_kv_heads=2, head_dim=5, dtype=torch.float16)
    assert pool.capacity == 10
    assert len(pool.k_buffers) == len(pool.v_buffers) == 3
    for buf in pool.k_buffers + pool.v_buffers:
        assert buf.shape == (11, 2, 5)
        assert buf.dtype == torch.float16
        assert not buf.any()
    assert pool.available() == 10 and pool.used() == 0


def test_head_major_buffers_are_the_same_slots_stored_by_head():
    pool = KVPool(num_layers=2, num_slots=10, num_kv_heads=2, head_dim=5, head_major=True)
    for buf in pool.k_buffers + pool.v_buffers:
        assert buf.shape == (11, 2, 5) and not buf.any()
        assert buf.stride() == (5, 55, 1)  # a KV head's rows adjacent, slot after slot
        assert buf.permute(1, 0, 2).is_contiguous()
    row = torch.arange(10.0).view(2, 5)
    pool.k_buffers[1][torch.tensor([4])] = row[None]
    assert torch.equal(pool.k_buffers[1][4], row)
    assert torch.equal(pool.k_buffers[1].permute(1, 0, 2)[:, 4], row)


def test_alloc_and_free_roundtrip():
    pool = make_pool(8)
    a = pool.alloc(3)
    assert a.dtype == torch.int64 and a.device.type == "cpu"
    assert a.tolist() == [1, 2, 3]
    b = pool.alloc(5)
    assert sorted(a.tolist() + b.tolist()) == list(range(1, 9))
    assert pool.available() == 0 and pool.used() == 8
    pool.free(a)
    assert pool.available() == 3
    c = pool.alloc(3)
    assert sorted(c.tolist()) == [1, 2, 3]  # freed slots are reused
    pool.free(b)
    pool.free(c)
    assert pool.available() == 8
    assert pool.alloc(0).numel() == 0
    pool.free(torch.empty(0, dtype=torch.int64))


def test_exhaustion_returns_none_and_allocates_nothing():
    pool = make_pool(4)
    held = pool.alloc(3)
    assert pool.alloc(2) is None
    assert pool.available() == 1
    last = pool.alloc(1)
    assert last.tolist() == [4]
    assert pool.alloc(1) is None
    pool.free(held)
    pool.free(last)
    assert pool.available() == 4


def test_slot_zero_never_handed_out():
    pool = make_pool(16)
    for _ in range(5):
        slots = pool.alloc(16)
        assert 0 not in slots.tolist()
        assert sorted(slots.tolist()) == list(range(1, 17))
        pool.free(slots[torch.randperm(16)])


def test_double_free_raises_and_frees_nothing():
    pool = make_pool(8)
    a = pool.alloc(4)
    pool.free(a[:2])
    with pytest.raises(ValueError, match=f"double free of KV slot {int(a[0])}"):
        pool.free(a)  # a[0] is already free
    assert pool.available() == 6  # a[2:] was not freed by the failed call
    with pytest.raises(ValueError, match=f"double free of KV slot {int(a[2])}"):
        pool.free(torch.stack([a[2], a[3], a[2]]))  # the same slot twice in one call
    assert pool.available() == 6
    pool.free(a[2:])
    assert pool.available() == 8


@pytest.mark.parametrize("bad", [0, -1, 9, 100])
def test_free_rejects_padding_and_out_of_range(bad):
    pool = make_pool(8)
    pool.alloc(8)
    with pytest.raises(ValueError, match=f"KV slot {bad} "):
        pool.free(torch.tensor([1, bad]))
    assert pool.available() == 0


def test_big_calls_are_checked_too():
    # Calls above the small-call threshold take the vectorised path; same rules apply.
    pool = make_pool(200)
    a = pool.alloc(100)
    with pytest.raises(ValueError, match="KV slot 0 "):
        pool.free(torch.cat([a, torch.tensor([0])]))
    with pytest.raises(ValueError, match="KV slot 201 "):
        pool.free(torch.cat([a, torch.tensor([201])]))
    with pytest.raises(ValueError, match=f"double free of KV slot {int(a[7])}"):
        pool.free(torch.cat([a, a[7:8]]))
    free_one = pool.alloc(1)
    pool.free(free_one)
    with pytest.raises(ValueError, match=f"double free of KV slot {int(free_one)}"):
        pool.free(torch.cat([a, free_one]))
    assert pool.available() == 100
    pool.free(a)
    assert pool.available() == 200
    b = pool.alloc(200)
    assert sorted(b.tolist()) == list(range(1, 201))
