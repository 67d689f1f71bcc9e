"""agentrl-gateway: the `agentrl` command and what the gateway and trainer share."""
