from engine_core.worker.threads import EXPLORE_EVERY, LONG_STEP_S, WARMUP, ThreadPolicy


def run(policy: ThreadPolicy, tokens: int, cost: dict[int, float], steps: int) -> list[int]:
    """Drive `steps` steps of `tokens` tokens whose time per token is cost[threads] µs."""
    used = []
    for _ in range(steps):
        n = policy.choose(tokens)
        policy.record(tokens, n, cost[n] * tokens * 1e-6)
        used.append(n)
    return used


def test_measures_each_count_then_keeps_the_faster_and_tries_the_other_now_and_then():
    policy = ThreadPolicy((1, 2), set_threads=lambda n: None)
    used = run(policy, 512, {1: 2.0, 2: 1.0}, 200)
    assert used[:2 * WARMUP] == [1, 2] * WARMUP  # taking turns
    later = used[2 * WARMUP:]
    assert later.count(2) > 0.9 * len(later)
    assert 0 < later.count(1) <= len(later) // EXPLORE_EVERY + 1
    assert policy.best() == {(512).bit_length(): 2}


def test_long_steps_are_measured_once_on_each_count():
    """A real model's prefill chunk takes seconds: three on the slower count would cost more
    than a wrong choice, which exploring corrects anyway."""
    policy = ThreadPolicy((1, 2), set_threads=lambda n: None)
    per_token = LONG_STEP_S / 1024 * 1e6
    used = run(policy, 1024, {1: 3 * per_token, 2: 1.5 * per_token}, 40)
    assert used[:3] == [1, 2, 2] and used[2:].count(1) <= 1
    assert policy.best() == {(1024).bit_length(): 2}


def test_one_slow_step_does_not_cut_the_measuring_short():
    """Short steps, the first on one thread slowed by a one-off cost: still WARMUP each."""
    policy = ThreadPolicy((1, 2), set_threads=lambda n: None)
    policy.record(64, policy.choose(64), 10 * LONG_STEP_S)
    used = run(policy, 64, {1: 10.0, 2: 20.0}, 2 * WARMUP - 2)
    assert used == [2, 1] * (WARMUP - 1) and policy.best() == {}


def test_each_step_size_learns_on_its_own():
    policy = ThreadPolicy((1, 2), set_threads=lambda n: None)
    run(policy, 16, {1: 1.0, 2: 3.0}, 50)  # small steps: the second thread stalls them
    run(policy, 1024, {1: 2.0, 2: 1.2}, 50)  # big steps: it pays
    assert policy.best() == {(16).bit_length(): 1, (1024).bit_length(): 2}


def test_a_much_worse_count_is_tried_less_often():
    near = run(ThreadPolicy((1, 2), set_threads=lambda n: None), 64, {1: 1.0, 2: 1.1}, 600)
    far = run(ThreadPolicy((1, 2), set_threads=lambda n: None), 64, {1: 1.0, 2: 4.0}, 600)
    assert far.count(2) < near.count(2) / 4


def test_it_follows_a_change_in_which_is_faster():
    """A frontend that becomes busy makes the second thread a loss: the policy notices."""
    policy = ThreadPolicy((1, 2), set_threads=lambda n: None)
    run(policy, 256, {1: 2.0, 2: 1.0}, 100)
    used = run(policy, 256, {1: 2.0, 2: 5.0}, 100)
    assert used[-50:].count(1) > 45


def test_step_sets_torch_threads_only_when_they_change():
    calls: list[int] = []
    policy = ThreadPolicy((1, 2), set_threads=calls.append)
    for _ in range(2 * WARMUP):  # 1 and 2 threads in turn
        with policy.step(8):
            pass
    assert calls == [1, 2] * WARMUP


def test_a_fixed_count_is_set_once_and_never_measured():
    calls: list[int] = []
    policy = ThreadPolicy((3,), set_threads=calls.append)
    for tokens in (1, 8, 2048, 8):
        with policy.step(tokens) as n:
            assert n == 3
    assert calls == [3] and policy.best() == {}


def test_no_choices_leaves_torch_alone():
    calls: list[int] = []
    policy = ThreadPolicy((), set_threads=calls.append)
    with policy.step(64):
        pass
    assert calls == []


def test_more_threads_only_for_a_clear_gain():
    """A 10% gain does not take a core from the frontends; a 40% one does."""
    small = ThreadPolicy((1, 2), set_threads=lambda n: None)
    run(small, 64, {1: 1.1, 2: 1.0}, 100)
    large = ThreadPolicy((1, 2), set_threads=lambda n: None)
    run(large, 64, {1: 1.4, 2: 1.0}, 100)
    assert small.best() == {(64).bit_length(): 1} and large.best() == {(64).bit_length(): 2}
