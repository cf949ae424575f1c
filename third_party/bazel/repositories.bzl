"""Repositories for jcxl's Bazel build, all read from the local machine.

`jcxl_repositories()` defines `@jcxl_python`: the Python headers, jaxlib's
XLA FFI headers, nanobind's sources and a Python toolchain, all taken from
one Python interpreter that has `jax` and `nanobind` installed. Nothing is
downloaded.

The interpreter is `$JCXL_PYTHON` when set (pass it with
`--repo_env=JCXL_PYTHON=/path/to/python`; `tools/bazel_setup.sh` writes that
line into `.bazelrc.local`), else `python3` on `PATH`.
"""

_PROBE = """
import os, sys, sysconfig
try:
    import jax, nanobind
except ImportError as e:
    sys.exit("jcxl: this Python lacks jax or nanobind (%s)" % e)
print(sys.executable)
print(sysconfig.get_paths()["include"])
print(jax.ffi.include_dir())
print(os.path.dirname(nanobind.include_dir()))
"""

def _python_configure_impl(ctx):
    python = ctx.os.environ.get("JCXL_PYTHON", "")
    if not python:
        found = ctx.which("python3")
        if not found:
            fail("jcxl: no python3 on PATH; set --repo_env=JCXL_PYTHON=" +
                 "/path/to/python (tools/bazel_setup.sh does this).")
        python = str(found)
    result = ctx.execute([python, "-c", _PROBE])
    if result.return_code != 0:
        fail(("jcxl: could not query {python}: {err}\nInstall jax and " +
              "nanobind into it (pip install jax nanobind), or point " +
              "--repo_env=JCXL_PYTHON at one that has them.").format(
            python = python,
            err = result.stderr.strip() or result.stdout.strip(),
        ))
    lines = result.stdout.strip().splitlines()
    executable, python_include, ffi_include, nb_root = lines[-4:]

    if not ctx.path(python_include + "/Python.h").exists:
        fail("jcxl: no Python.h in %s; install Python's development headers." %
             python_include)
    ctx.symlink(python_include, "python_include")
    ctx.symlink(ffi_include, "xla_ffi_include")
    for sub in ["include", "src", "ext"]:
        ctx.symlink(nb_root + "/" + sub, "nanobind/" + sub)
    ctx.template("BUILD.bazel", ctx.attr._build_file, {
        "%{python}": executable,
    })

python_configure = repository_rule(
    implementation = _python_configure_impl,
    environ = ["JCXL_PYTHON", "PATH"],
    local = True,
    attrs = {
        "_build_file": attr.label(
            default = Label("//third_party/bazel:jcxl_python.BUILD"),
        ),
    },
)

def jcxl_repositories():
    """Defines the external repositories that jcxl's BUILD file uses."""
    if not native.existing_rule("jcxl_python"):
        python_configure(name = "jcxl_python")
