"""The foundation: settings, names, the row model, errors, redaction, tracing."""
