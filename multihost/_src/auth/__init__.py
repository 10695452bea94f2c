"""The job's secret and what is signed with it in the coordination service: job keys and the MAC'd marks every barrier leaves."""
