"""``python -m experiments.train``: see the package's docstring."""

from absl import app

from experiments import host_allocator
from experiments import train

if __name__ == "__main__":
  host_allocator.start()
  app.run(train.main, flags_parser=train.parse_flags)
