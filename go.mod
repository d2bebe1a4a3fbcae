module github.com/idemhttp/idemhttp

go 1.25.0
