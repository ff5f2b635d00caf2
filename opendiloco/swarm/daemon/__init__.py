"""hivemind's DHT and p2p daemon as this project starts and calls them: the node, its DHT calls, the daemon
binary and its flags, and the one adapter to hivemind's private attributes."""
