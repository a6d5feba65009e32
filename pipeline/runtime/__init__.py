"""Process plumbing: settings, logging, metrics, liveness and the supervisor every xidflow process shares."""
