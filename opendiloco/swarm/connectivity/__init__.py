"""Reaching peers through what the network does to them: addresses that change, NAT (relays, their slots,
connection reversal), the dial-back check, a lost DHT, frozen peers, and the watch over them in a round."""
