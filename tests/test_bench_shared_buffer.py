"""bench/shared_buffer.py on the CPU: a shared stack holds one Buffer, an unshared one a Buffer a layer."""

from bench.shared_buffer import CPU_SMOKE, measure


def test_a_shared_stack_holds_one_buffer_and_a_stack_of_own_buffers_one_per_layer():
    shapes = {**CPU_SMOKE, "ffn_hidden_size": 8, "dtype": "float32"}
    shared, own = (measure(shapes, share, layers=3, device="cpu") for share in (True, False))
    assert (shared["buffers"], own["buffers"]) == (1, 3)
    assert shared["buffer_gib"] == own["buffer_gib"] > 0
    assert own["comm_gib"] == 3 * shared["comm_gib"]
