"""Views of schedules and Traces: terminal timeline, SVG/HTML pictures, PNG screenshots, Chrome
trace JSON."""
