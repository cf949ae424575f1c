"""Where two pytrees first differ, said in one line (a whole PyTreeDef of a
model runs to kilobytes)."""

from __future__ import annotations

from typing import Any

import jax

_SHORT = 160  # characters of a structure kept in a message


def _one_level(tree: Any) -> tuple[Any, list[tuple[Any, Any]]]:
  """The root's node (its PyTreeDef, children as leaves) and children."""
  children, treedef = jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: x is not tree)
  return treedef, [(path[0], child) for path, child in children
                   if path]  # a leaf root has one child with an empty path


def _kind(tree: Any, treedef: Any) -> str:
  if treedef.num_nodes == 1 and treedef.num_leaves == 1:
    shape = getattr(tree, "shape", None)
    dtype = getattr(tree, "dtype", None)
    if shape is not None and dtype is not None:
      return f"an array {dtype}{list(shape)}"
    return f"a leaf ({type(tree).__name__})"
  if tree is None:
    return "None"
  if isinstance(tree, dict):
    return f"a dict with keys {sorted(map(str, tree))}"
  if isinstance(tree, (tuple, list)):
    return f"a {type(tree).__name__} of {len(tree)}"
  return f"a {type(tree).__name__}"


def first_difference(got: Any, want: Any, path: str = "") -> str | None:
  """Where `got`'s structure first departs from `want`'s, in words (None
  if they have the same structure)."""
  got_def, got_children = _one_level(got)
  want_def, want_children = _one_level(want)
  where = path or "the top"
  got_is_leaf = not got_children and got_def.num_leaves == 1
  want_is_leaf = not want_children and want_def.num_leaves == 1
  if got_is_leaf and want_is_leaf:
    return None
  if got_is_leaf != want_is_leaf or type(got) is not type(want):
    return (f"at {where}: {_kind(got, got_def)} where "
            f"{_kind(want, want_def)} was expected")
  got_keys = [k for k, _ in got_children]
  want_keys = [k for k, _ in want_children]
  if got_keys != want_keys:
    missing = [k for k in want_keys if k not in got_keys]
    extra = [k for k in got_keys if k not in want_keys]
    if missing:
      return f"at {path + jax.tree_util.keystr((missing[0],))}: missing"
    if extra:
      return f"at {path + jax.tree_util.keystr((extra[0],))}: not expected"
    return (f"at {where}: keys in another order "
            f"({[str(k) for k in got_keys]})")
  for (key, g), (_, w) in zip(got_children, want_children):
    found = first_difference(g, w, path + jax.tree_util.keystr((key,)))
    if found:
      return found
  if got_def.node_data() != want_def.node_data():
    return (f"at {where}: {_kind(got, got_def)} whose static fields differ "
            "from the expected one's")
  return None


def short(treedef: Any) -> str:
  """A PyTreeDef's text, cut to a line or two."""
  text = str(treedef)
  return text if len(text) <= _SHORT else text[:_SHORT] + "..."


def leaf_paths(tree: Any) -> list[tuple[Any, ...]]:
  """Each leaf's key path, with the type of every container on the way:
  two trees' leaves with equal entries sit at the same place in containers
  of the same kinds (a dict turned into a list, or a key dropped, is not
  the same place)."""
  treedef, children = _one_level(tree)
  if not children:
    return [()] * treedef.num_leaves  # a leaf (1) or an empty node (0)
  return [((type(tree), key),) + rest for key, child in children
          for rest in leaf_paths(child)]
