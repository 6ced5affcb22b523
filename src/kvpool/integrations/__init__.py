"""kvpool inside other inference engines: their offloading and storage plug-in points."""
