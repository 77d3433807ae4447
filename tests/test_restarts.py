"""serve's restart policy for stages that exit or hang: back off, never give a stage up."""

from omni_server.orchestrator.restarts import HEALTHY_S, MAX_DELAY_S, RestartPolicy


def test_a_crash_loop_backs_off_to_the_cap_and_keeps_restarting():
    """Each crash in a row doubles the delay up to the cap; the 50th crash is still restarted (a
    server that gave the stage up stayed 503 until restarted by hand: a few requests that crash or
    hang a stage were enough)."""
    policy, now, delays = RestartPolicy(), 0.0, []
    for _ in range(50):
        delay, streak = policy.crashed("talker", now)
        delays.append(delay)
        now += delay + 5.0  # restarted, then crashed 5 s later
    assert delays[:9] == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert delays[9:] == [MAX_DELAY_S] * 41 and streak == 50


def test_a_stage_that_ran_long_enough_starts_again_from_one_second():
    policy = RestartPolicy()
    assert [policy.crashed("t2w", t)[0] for t in (0.0, 10.0, 30.0)] == [1, 2, 4]
    # restarted at 34 s; crashing HEALTHY_S after that is a new, unrelated crash
    assert policy.crashed("t2w", 34.0 + HEALTHY_S) == (1, 1)
    # just short of it still counts as the same loop
    assert policy.crashed("t2w", 35.0 + HEALTHY_S + HEALTHY_S - 1) == (2, 2)


def test_units_back_off_each_on_its_own():
    policy = RestartPolicy()
    policy.crashed((1, 0), 0.0)
    policy.crashed((1, 0), 2.0)
    assert policy.crashed((1, 1), 3.0) == (1, 1)  # another replica of that stage
    assert policy.crashed((1, 0), 7.0) == (4, 3)
