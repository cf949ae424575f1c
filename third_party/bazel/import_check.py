"""Checks that `import jcxl` loads the extension module that Bazel built.

Run as `bazel test //:import_test`; outside Bazel the first check fails on
purpose, since the extension then comes from somewhere else.
"""

import sys
import unittest


class ImportTest(unittest.TestCase):

  def test_extension_comes_from_runfiles(self):
    import jcxl
    from jcxl import _jcxl

    self.assertTrue(jcxl.__all__)
    self.assertIn(
        ".runfiles", _jcxl.__file__,
        "jcxl._jcxl was not loaded from this target's runfiles; is an "
        "editable jcxl install shadowing it? (tools/bazel_setup.sh avoids "
        "that)",
    )

  def test_registrations_are_ffi_capsules(self):
    from jcxl import _jcxl

    if not hasattr(_jcxl, "registrations"):
      self.skipTest("this jcxl._jcxl has no registrations() table")
    targets = dict(_jcxl.registrations())
    self.assertTrue(targets, "registrations() is empty")
    for name, capsule in targets.items():
      self.assertTrue(name.startswith("jcxl_"), name)
      self.assertEqual(type(capsule).__name__, "PyCapsule", name)


if __name__ == "__main__":
  unittest.main(argv=sys.argv[:1])
