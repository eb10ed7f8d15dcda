"""fedhog: federated learning with higher-order differential-privacy mixing."""
