import threading

from graphopt.executor.numerics import BackwardPassGuard, Numerics

is_bwd = BackwardPassGuard.is_backward_pass


def test_nested_guards_restore_the_previous_state():
    assert not is_bwd()
    with BackwardPassGuard():
        with BackwardPassGuard():
            assert is_bwd()
        assert is_bwd()  # ORT's guard would have reset this to false
    assert not is_bwd()


def test_forward_region_inside_backward():
    with BackwardPassGuard():
        with BackwardPassGuard(active=False):
            assert not is_bwd()
        assert is_bwd()


def test_same_guard_object_reentered():
    guard = BackwardPassGuard()
    with guard:
        with guard:
            assert is_bwd()
        assert is_bwd()
    assert not is_bwd()


def test_state_restored_when_the_body_raises():
    try:
        with BackwardPassGuard():
            raise RuntimeError("kernel failed")
    except RuntimeError:
        pass
    assert not is_bwd()


def test_thread_local():
    seen = {}
    inside = threading.Event()
    release = threading.Event()

    def other_thread():
        seen["start"] = is_bwd()  # main thread is inside its guard right now
        with BackwardPassGuard():
            seen["own_guard"] = is_bwd()
            inside.set()
            release.wait(5)

    with BackwardPassGuard():
        worker = threading.Thread(target=other_thread)
        worker.start()
        assert inside.wait(5)
        assert is_bwd()
    assert not is_bwd()  # the worker's guard is still open, but it is not ours
    release.set()
    worker.join(5)
    assert seen == {"start": False, "own_guard": True}


def test_numerics_backward_pass_is_the_module_guard():
    numerics = Numerics(mode="native")
    with numerics.backward_pass():
        assert is_bwd()
        assert numerics.implementation_for("gemm") == "alternate"
    assert numerics.implementation_for("gemm") == "original"
