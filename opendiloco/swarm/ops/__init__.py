"""What an operator runs: `opendiloco status` and its page, `opendiloco doctor`, the container health check."""
