"""Flax NNX's checkpointing guide, step by step, with asyncckpt's checkpointer.

Written for asyncckpt's tests after Flax's guide "Save and load checkpoints"
(``docs_nnx/guides/checkpointing``) and the "Load a sharded model from a
checkpoint" section of its "Scale up on multiple devices" guide. The guide's
code imports ``orbax.checkpoint as ocp``; here that one import is changed to
asyncckpt's, everything else is the guide's API usage (``nnx.split``,
``nnx.state``, ``nnx.eval_shape``, ``nnx.merge``, ``nnx.update``, pure
dicts, ``StandardCheckpointer().save`` / ``restore`` with an abstract
state). The guide's own checks are kept; after the guide's steps, the same
files are also restored with orbax's own ``StandardCheckpointer``.

Usage: python flax_nnx_guide.py <empty directory>   (8 CPU devices via XLA_FLAGS)
"""

import sys

import jax
import numpy as np
from etils import epath
from flax import nnx
from jax import numpy as jnp
from jax.sharding import PartitionSpec as P

import asyncckpt.jax as ocp  # the guide: import orbax.checkpoint as ocp

ckpt_dir = epath.Path(sys.argv[1])  # the guide: ocp.test_utils.erase_and_create_empty(...)


class TwoLayerMLP(nnx.Module):
    def __init__(self, dim, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(dim, dim, rngs=rngs, use_bias=False)
        self.linear2 = nnx.Linear(dim, dim, rngs=rngs, use_bias=False)

    def __call__(self, x):
        return self.linear2(self.linear1(x))


model = TwoLayerMLP(4, rngs=nnx.Rngs(0))
x = jax.random.normal(jax.random.key(42), (3, 4))
assert model(x).shape == (3, 4)
expected_y = model(x)

# -- Save checkpoints: the model's state pytree, from nnx.split --------------------------
_, state = nnx.split(model)
checkpointer = ocp.StandardCheckpointer()
checkpointer.save(ckpt_dir / "state", state)

# -- Restore checkpoints: into the abstract state of a model never allocated -------------
abstract_model = nnx.eval_shape(lambda: TwoLayerMLP(4, rngs=nnx.Rngs(0)))
graphdef, abstract_state = nnx.split(abstract_model)
state_restored = checkpointer.restore(ckpt_dir / "state", abstract_state)
jax.tree.map(np.testing.assert_array_equal, state, state_restored)
model = nnx.merge(graphdef, state_restored)
assert model(x).shape == (3, 4)
np.testing.assert_array_equal(model(x), expected_y)

# -- Save and restore as pure dictionaries ------------------------------------------------
pure_dict_state = nnx.to_pure_dict(state)
checkpointer.save(ckpt_dir / "pure_dict", pure_dict_state)
restored_pure_dict = checkpointer.restore(ckpt_dir / "pure_dict")
abstract_model = nnx.eval_shape(lambda: TwoLayerMLP(4, rngs=nnx.Rngs(0)))
graphdef, abstract_state = nnx.split(abstract_model)
nnx.replace_by_pure_dict(abstract_state, restored_pure_dict)
model = nnx.merge(graphdef, abstract_state)
assert model(x).shape == (3, 4)
np.testing.assert_array_equal(model(x), expected_y)


# -- Restore when checkpoint structures differ: the new model needs biases ----------------
class ModifiedTwoLayerMLP(nnx.Module):
    def __init__(self, dim, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(dim, dim, rngs=rngs, use_bias=True)
        self.linear2 = nnx.Linear(dim, dim, rngs=rngs, use_bias=True)

    def __call__(self, x):
        return self.linear2(self.linear1(x))


restored_pure_dict = checkpointer.restore(ckpt_dir / "pure_dict")
restored_pure_dict["linear1"]["bias"] = jnp.zeros((4,))
restored_pure_dict["linear2"]["bias"] = jnp.zeros((4,))
abstract_model = nnx.eval_shape(lambda: ModifiedTwoLayerMLP(4, rngs=nnx.Rngs(0)))
graphdef, abstract_state = nnx.split(abstract_model)
nnx.replace_by_pure_dict(abstract_state, restored_pure_dict)
model = nnx.merge(graphdef, abstract_state)
assert model(x).shape == (3, 4)
np.testing.assert_allclose(model(x), expected_y, rtol=1e-6)  # zero biases: same outputs


# -- Multi-device: a sharded model's state, restored onto its sharding and onto another ---
class DotReluDot(nnx.Module):
    def __init__(self, depth: int, rngs: nnx.Rngs):
        init_fn = nnx.initializers.lecun_normal()
        self.dot1 = nnx.Linear(depth, depth, use_bias=False, rngs=rngs,
                               kernel_init=nnx.with_partitioning(init_fn, (None, "model")))
        self.w2 = nnx.Param(init_fn(rngs.params(), (depth, depth)), sharding=("model", None))

    def __call__(self, x):
        return jnp.dot(jax.nn.relu(self.dot1(x)), self.w2[...])


mesh = jax.make_mesh((2, 4), ("data", "model"))
with jax.set_mesh(mesh):
    sharded_model = nnx.merge(*nnx.split(DotReluDot(64, rngs=nnx.Rngs(0))))
    sharded_model = nnx.jit(lambda m: m)(sharded_model)  # places each Param on its sharding
sharded_state = nnx.state(sharded_model)
assert sharded_state["dot1"]["kernel"][...].sharding.spec == P(None, "model")
checkpointer.save(ckpt_dir / "checkpoint_name", sharded_state)

graphdef, abs_state = nnx.get_abstract_model(lambda: DotReluDot(64, rngs=nnx.Rngs(0)), mesh)
restored_state = checkpointer.restore(ckpt_dir / "checkpoint_name", target=abs_state)
restored_model = nnx.merge(graphdef, restored_state)
assert restored_model.dot1.kernel.sharding.spec == P(None, "model")
assert restored_model.dot1.kernel.shape == (64, 64)
jax.tree.map(np.testing.assert_array_equal, sharded_state, restored_state)

# Onto another mesh (8 devices in one axis): the state restores resharded, and
# nnx.update puts it into a live model built on that mesh.
mesh8 = jax.make_mesh((8,), ("model",))
graphdef8, abs_state8 = nnx.get_abstract_model(lambda: DotReluDot(64, rngs=nnx.Rngs(1)), mesh8)
resharded = checkpointer.restore(ckpt_dir / "checkpoint_name", abs_state8)
assert resharded["w2"][...].sharding.mesh.shape == {"model": 8}
with jax.set_mesh(mesh8):
    live = nnx.jit(lambda m: m)(DotReluDot(64, rngs=nnx.Rngs(1)))
nnx.update(live, resharded)
jax.tree.map(np.testing.assert_array_equal, sharded_state, nnx.state(live))
checkpointer.wait_until_finished()

# -- The same files, read by orbax's own checkpointer -------------------------------------
import orbax.checkpoint  # noqa: E402

with orbax.checkpoint.StandardCheckpointer() as orbax_checkpointer:
    _, abstract_state = nnx.split(nnx.eval_shape(lambda: TwoLayerMLP(4, rngs=nnx.Rngs(0))))
    by_orbax = orbax_checkpointer.restore(ckpt_dir / "state", abstract_state)
    jax.tree.map(np.testing.assert_array_equal, state, by_orbax)
    by_orbax = orbax_checkpointer.restore(ckpt_dir / "pure_dict")
    jax.tree.map(np.testing.assert_array_equal, pure_dict_state, by_orbax)
    by_orbax = orbax_checkpointer.restore(ckpt_dir / "checkpoint_name", abs_state)
    jax.tree.map(np.testing.assert_array_equal, sharded_state, by_orbax)
    assert by_orbax["dot1"]["kernel"][...].sharding.spec == P(None, "model")
checkpointer.close()
print("GUIDE OK")
