"""Runs jcxl's pytest suite (tests/) against the package that Bazel built.

`bazel test //:pytest` runs it; arguments after `--test_arg=` go to pytest,
e.g. `--test_arg=-k --test_arg=topology`.
"""

import os
import sys

import pytest


def main() -> int:
  # This file sits at <runfiles>/<workspace>/third_party/bazel/; keep the
  # runfiles path (no realpath) so that tests import the Bazel-built jcxl.
  here = os.path.dirname(os.path.abspath(__file__))
  root = os.path.dirname(os.path.dirname(here))
  args = [
      "-p", "no:cacheprovider",
      "--rootdir", root,
      os.path.join(root, "tests"),
  ] + sys.argv[1:]
  return pytest.main(args)


if __name__ == "__main__":
  sys.exit(main())
