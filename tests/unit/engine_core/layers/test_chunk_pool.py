import ctypes
import threading

import pytest

from engine_core.layers.chunk_pool import ChunkPool


def test_pool_runs_every_index_once_and_reraises():
    pool = ChunkPool(3)
    assert pool.map(lambda i: i * i, 50) == [i * i for i in range(50)]

    def boom(i: int) -> int:
        if i == 7:
            raise ValueError("chunk 7")
        return i

    with pytest.raises(ValueError, match="chunk 7"):
        pool.map(boom, 20)
    assert pool.map(lambda i: i, 5) == list(range(5))  # still usable afterwards


def test_use_limits_the_threads_of_the_next_maps():
    pool = ChunkPool(2)

    def threads_seen(n: int) -> set[int]:
        seen: set[int] = set()
        barrier = threading.Barrier(2, timeout=0.5)

        def chunk(i: int) -> None:
            seen.add(threading.get_ident())
            if i == 0:  # with two threads, both meet here; alone, the wait times out
                try:
                    barrier.wait()
                except threading.BrokenBarrierError:
                    pass
        pool.map(chunk, n)
        return seen

    pool.use(1)
    assert threads_seen(4) == {threading.get_ident()}
    pool.use(5)  # capped at the pool's own
    assert pool.active == 2


def test_helpers_run_their_torch_ops_on_one_thread():
    # A thread OpenMP did not start has its default team size (every core): each torch op a
    # helper ran would start a team of its own and oversubscribe the cores.
    omp_max_threads = getattr(ctypes.CDLL(None), "omp_get_max_threads", None)
    if omp_max_threads is None:
        pytest.skip("torch here is not built with OpenMP")
    default: list[int] = []
    plain = threading.Thread(target=lambda: default.append(omp_max_threads()))
    plain.start()
    plain.join()
    if default[0] < 2:
        pytest.skip("OpenMP's default team is one thread here: nothing to oversubscribe")
    pool = ChunkPool(2)
    main = threading.get_ident()
    barrier = threading.Barrier(2, timeout=5)

    def chunk(i: int) -> tuple[int, int]:
        if i < 2:  # the first two chunks meet here: one of them is the helper's
            barrier.wait()
        return threading.get_ident(), omp_max_threads()

    seen = pool.map(chunk, 4)
    helpers = [n for ident, n in seen if ident != main]
    assert helpers and all(n == 1 for n in helpers)
