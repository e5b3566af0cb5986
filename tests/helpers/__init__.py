"""What several test folders share: tiny engines, schedulers, fake servers, model directories, subprocesses."""
