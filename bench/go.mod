module github.com/idemhttp/idemhttp/bench

go 1.25.0

replace github.com/idemhttp/idemhttp => ../
