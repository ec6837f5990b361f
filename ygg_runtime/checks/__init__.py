"""What an artifact must pass on this machine: `integrity` (its files, the machine it was built for,
the memory it needs) and `exactness` (whether the row check's guarantee holds here and from which
width). Above the backend (they name the device) and the schema; the decoder and loading read them."""
