"""The dynamic scopes tracing reads are per thread: two threads tracing at once each see only the layer
context, pipeline stage, gather groups and shape view they entered themselves (`sharding.scopes.ThreadStack`).

Each test pauses another thread inside its scope (in the middle of a trace where there is one) and
checks, in this thread, what model code sees meanwhile; with the scopes held in module globals, this
thread would see (and write into) the other's."""
import ast
import contextlib
import pathlib
import threading

import jax
import jax.numpy as jnp
import numpy as np

import zeroflax
from zeroflax.pipeline.executor import active_stage, stage_hook
from zeroflax.sharding.context import GatherUsage, LayerContext, current_context, layer_context
from zeroflax.sharding.groups import in_group
from zeroflax.sharding.handles import ShardedLeaf, global_shape_view
from zeroflax.sharding.linen_groups import loss_scope
from zeroflax.sharding.mesh import DATA_AXIS
from zeroflax.sharding.scopes import ThreadStack

WAIT_S = 60


@contextlib.contextmanager
def paused_in_other_thread(work):
    """Runs `work(pause)` in another thread and yields once it calls `pause()`: the thread then waits
    there, inside whatever scopes it entered, until this context exits. Re-raises the thread's error."""
    inside, release, errors = threading.Event(), threading.Event(), []

    def pause():
        inside.set()
        assert release.wait(WAIT_S), "the main thread never released the paused one"

    def run():
        try:
            work(pause)
        except BaseException as error:  # noqa: BLE001 (re-raised in the main thread)
            errors.append(error)
        finally:
            inside.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        assert inside.wait(WAIT_S), "the other thread never reached its pause"
        if errors:
            raise errors[0]
        yield
    finally:
        release.set()
        thread.join(WAIT_S)
    assert not thread.is_alive()
    if errors:
        raise errors[0]


def _stack(depth: int):
    return {"w": jnp.arange(2.0, 2.0 + depth)}  # layers multiplying the carry by 2, 3, ...


def test_layer_context_is_per_thread_while_both_trace():
    usage, seen = GatherUsage(), {}
    theirs = LayerContext(remat="full", usage=usage)

    def work(pause):
        def body(carry, layer):
            pause()  # mid-trace, inside its context and its scan
            seen["theirs"] = current_context()
            return carry * layer["w"]

        with layer_context(theirs):
            jax.eval_shape(lambda c, p: zeroflax.scan_layers(body, c, p), jnp.ones(()), _stack(2))

    with paused_in_other_thread(work):
        seen["mine before"] = current_context()
        # This thread traces a scan of its own meanwhile: outside any context it is a plain scan.
        out = jax.eval_shape(lambda c, p: zeroflax.scan_layers(lambda c, l: c * l["w"], c, p), jnp.ones(()), _stack(3))
        mine = LayerContext(remat="dots")
        with layer_context(mine):
            seen["mine inside"] = current_context()
        seen["mine after"] = current_context()
    assert out.shape == ()
    assert seen["mine before"] is None and seen["mine after"] is None
    assert seen["mine inside"] is mine
    assert seen["theirs"] is theirs
    # Only the other thread's own scan was counted in its usage (this thread's plain scan was not).
    assert usage.remat_regions == 1
    assert usage.layer_carry_bytes == 4


def test_stage_hook_is_per_thread():
    seen = {}

    def work(pause):
        with stage_hook(None, 0, 1) as stage:
            seen["stage"] = stage
            pause()
            seen["theirs"] = active_stage()

    with paused_in_other_thread(work):
        seen["mine"] = active_stage()
        # scan_layers here runs all three layers on its own carry, not the other thread's one-layer chunk.
        out = zeroflax.scan_layers(lambda c, l: c * l["w"], jnp.ones(()), _stack(3))
    assert seen["mine"] is None
    assert seen["theirs"] is seen["stage"]
    assert seen["stage"].calls == 0 and seen["stage"].output is None
    np.testing.assert_allclose(out, 2.0 * 3.0 * 4.0)


def test_loss_scope_groups_and_shape_view_are_per_thread():
    seen = {}
    handle = ShardedLeaf(jnp.zeros((2, 3)), 0, DATA_AXIS, jnp.float32, (8, 3))

    def work(pause):
        def block(params, x):
            with global_shape_view():
                pause()  # inside the engine's loss scope, a gather group and a shape view
                seen["theirs"] = (current_context(), in_group(), jax.tree.leaves(handle)[0].shape)
            return x * params["w"]

        seen["ctx"] = LayerContext(remat="full", usage=GatherUsage())
        with loss_scope(seen["ctx"]):
            zeroflax.group(block, name="theirs")({"w": jnp.ones(())}, jnp.ones(()))

    with paused_in_other_thread(work):
        seen["mine"] = (current_context(), in_group(), jax.tree.leaves(handle)[0].shape)
        # A group of this thread's own, under its own context, is a group (not a call inside theirs).
        usage = GatherUsage()
        with layer_context(LayerContext(remat="full", usage=usage)):
            zeroflax.group(lambda p, x: x * p["w"], name="mine")({"w": jnp.ones(())}, jnp.ones(()))
    assert seen["mine"] == (None, False, (2, 3))  # no context, no group, a handle flattens to its shard
    assert seen["theirs"] == (seen["ctx"], True, (8, 3))
    assert list(usage.groups) == ["mine"]


def test_thread_stack():
    stack = ThreadStack()
    assert stack.top() is None and not stack and stack.top("none") == "none"
    with stack.push(1):
        with stack.push(2) as value:
            assert value == 2 and stack.top() == 2 and list(stack) == [1, 2]
            stack.set_top(3)
            assert stack.top() == 3
        assert stack.top() == 1 and len(stack) == 1
    assert not stack

    # With `bottom`, each thread's stack starts with a value of its own.
    levels = ThreadStack(bottom=list)
    levels.top().append("main")
    other = []
    thread = threading.Thread(target=lambda: other.append(levels.top()))
    thread.start()
    thread.join(WAIT_S)
    assert levels.top() == ["main"] and other == [[]]


def test_sharding_imports_nothing_above_it():
    """Imports run downward: the pipeline installs its stage runner in `sharding.layers` (`layer_runner`),
    the sharding layer never reaches up into the pipeline, the optimizers or the engine."""
    root = pathlib.Path(zeroflax.__file__).parent
    above = ("zeroflax.pipeline", "zeroflax.optim", "zeroflax.engine", "zeroflax.remat_choice")
    for path in sorted((root / "sharding").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not [n for n in names if n.startswith(above)], f"{path.name} imports {names}"
