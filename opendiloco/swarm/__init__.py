"""The swarm: DHT nodes, identities, progress records, and what an operator runs to see them."""
