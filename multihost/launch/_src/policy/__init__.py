"""The run policy within an attempt and across attempts (pure decisions, and stopping), and the result of a run of several attempts."""
