"""Named in ``multiprocessing``'s fork-server preload list by tests that start ranks as processes.

Importing it does, once in the fork server, what every rank would otherwise do on its own: import
torch and this package, take an optimizer step (which imports ``torch._dynamo``) and leave all of
that out of garbage collection (:func:`opendiloco.testing.prefork.settle`). Each rank is then forked
from the server instead of starting a fresh interpreter: about 5 s of CPU less per rank on 2 cores.
"""

from opendiloco.testing.prefork import settle

settle()
