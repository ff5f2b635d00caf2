"""A worker's state handed to joiners and to workers catching up: its layout in parts, serving and
fetching it (from one donor or several), and which state a worker downloads."""
